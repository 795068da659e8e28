"""One distribution installing npmegatron, npmegatron.autograd and npmegatron.comm, and never a
top-level `autograd` or `comm` (HIPS autograd's and Jupyter's names)."""
import importlib.metadata
import os

import setuptools  # first: on Python 3.12+ it provides distutils.core

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_installed_distribution_provides_only_npmegatron():
    dist = importlib.metadata.distribution("npmegatron")
    top_level = (dist.read_text("top_level.txt") or "").split()
    assert top_level == ["npmegatron"]
    owners = importlib.metadata.packages_distributions()
    for name in ("autograd", "comm"):
        assert "npmegatron" not in owners.get(name, [])


def test_setup_maps_the_folders_under_npmegatron():
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        from distutils.core import run_setup
        dist = run_setup("setup.py", stop_after="init")
    finally:
        os.chdir(cwd)
    assert all(p == "npmegatron" or p.startswith("npmegatron.") for p in dist.packages)
    assert dist.package_dir["npmegatron.autograd"] == "autograd"
    assert dist.package_dir["npmegatron.comm"] == "comm"
    assert "mpich" in dist.extras_require["mpi"]


def test_import_names():
    import npmegatron.autograd
    import npmegatron.comm
    assert os.path.basename(os.path.dirname(npmegatron.autograd.__file__)) == "autograd"
    assert npmegatron.autograd.Tensor is not None and npmegatron.comm.__doc__
