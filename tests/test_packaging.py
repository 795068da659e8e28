"""One distribution installing npmegatron, npmegatron.autograd and npmegatron.comm, and never a
top-level `autograd` or `comm` (HIPS autograd's and Jupyter's names).

The editable install used for development finds every subpackage on disk, so it cannot tell
whether setup.py declares them all: a hand-written package list once shipped wheels without
npmegatron.tensor_parallel and npmegatron.pipeline. The slow test therefore installs a real
wheel into a fresh venv and trains with it from outside the checkout."""
import glob
import importlib.metadata
import os
import shutil
import signal
import subprocess
import sys

import pytest
import setuptools  # first: on Python 3.12+ it provides distutils.core

from helpers import rank_environment

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Source folder -> import name (setup.py's package_dir).
FOLDERS = {"npmegatron": "npmegatron", "autograd": "npmegatron.autograd", "comm": "npmegatron.comm"}
TINY = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
        "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "2",
        "--eval-iters", "1", "--sample-tokens", "0"]


def source_packages():
    """Import name of every folder holding an __init__.py under the three source folders."""
    names = set()
    for folder, name in FOLDERS.items():
        top = os.path.join(ROOT, folder)
        for path, _, files in os.walk(top):
            if "__init__.py" in files:
                rel = os.path.relpath(path, top)
                names.add(name if rel == "." else name + "." + rel.replace(os.sep, "."))
    return names


def declared_setup():
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        from distutils.core import run_setup
        return run_setup("setup.py", stop_after="init")
    finally:
        os.chdir(cwd)


def test_installed_distribution_provides_only_npmegatron():
    dist = importlib.metadata.distribution("npmegatron")
    top_level = (dist.read_text("top_level.txt") or "").split()
    assert top_level == ["npmegatron"]
    owners = importlib.metadata.packages_distributions()
    for name in ("autograd", "comm"):
        assert "npmegatron" not in owners.get(name, [])


def test_setup_maps_the_folders_under_npmegatron():
    dist = declared_setup()
    assert all(p == "npmegatron" or p.startswith("npmegatron.") for p in dist.packages)
    assert dist.package_dir["npmegatron.autograd"] == "autograd"
    assert dist.package_dir["npmegatron.comm"] == "comm"
    assert "mpich" in dist.extras_require["mpi"]


def test_setup_declares_every_package_folder():
    assert {"npmegatron.tensor_parallel", "npmegatron.pipeline"} <= source_packages()
    missing = source_packages() - set(declared_setup().packages)
    assert not missing, f"setup.py does not declare {sorted(missing)}"


def test_import_names():
    import npmegatron.autograd
    import npmegatron.comm
    assert os.path.basename(os.path.dirname(npmegatron.autograd.__file__)) == "autograd"
    assert npmegatron.autograd.Tensor is not None and npmegatron.comm.__doc__


def run(cmd, timeout, check=True, **kwargs):
    """Run cmd in its own process group (so a hung mpiexec takes its ranks with it); on failure
    or timeout fail the test showing its output."""
    proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"timed out after {timeout} s: {cmd}\n--- stdout ---\n{out}\n--- stderr ---\n{err}")
    result = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    result.report = f"{cmd}: exit {proc.returncode}\n--- stdout ---\n{out}\n--- stderr ---\n{err}"
    if check and proc.returncode != 0:
        pytest.fail(result.report)
    return result


@pytest.mark.slow
def test_wheel_installs_and_trains_outside_the_checkout(tmp_path):
    # Build from a clean copy: an in-tree build writes build/ into the shared checkout, and
    # setuptools packs whatever a stale build/lib holds, which could hide a missing package.
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache"))
    wheels = tmp_path / "wheels"
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--disable-pip-version-check",
                 "-q", "-w", wheels, src]
    if run(pip_wheel + ["--no-build-isolation"], timeout=300, check=False).returncode != 0:
        run(pip_wheel, timeout=300)  # this env lacks `wheel`, which older setuptools needs
    (wheel,) = wheels.glob("npmegatron-*.whl")

    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", venv], timeout=120)
    bin_ = venv / "bin"
    run([bin_ / "pip", "install", "--disable-pip-version-check", "-q", f"{wheel}[mpi]"], timeout=300)

    # Outside the checkout, with no PYTHONPATH: only the installed wheel can be imported.
    env = rank_environment({"PATH": f"{bin_}{os.pathsep}{os.environ['PATH']}",
                            "VIRTUAL_ENV": str(venv)})
    env.pop("PYTHONPATH", None)
    work = tmp_path / "work"
    work.mkdir()
    where = run([bin_ / "python", "-c", "import npmegatron.tensor_parallel, npmegatron.pipeline "
                 "as p; print(p.__file__)"], timeout=60, cwd=work, env=env)
    assert where.stdout.startswith(str(venv)), where.report
    assert "Usage:" in run([bin_ / "npmegatron", "train", "--help"], timeout=60, cwd=work,
                           env=env).stdout
    one = run([bin_ / "npmegatron", "train", *TINY], timeout=120, cwd=work, env=env)
    assert "done: loss" in one.stdout, one.report
    two = run([bin_ / "mpiexec", "-n", "2", bin_ / "npmegatron", "train", "--tp", "2", *TINY],
              timeout=180, cwd=work, env=env)
    assert two.stdout.count("done: loss") == 1, two.report

    (record,) = glob.glob(str(venv / "lib/python*/site-packages/npmegatron-*.dist-info/RECORD"))
    with open(record) as f:
        installed = {line.split(",")[0] for line in f}
    expected = {name.replace(".", "/") + "/__init__.py" for name in source_packages()}
    assert expected <= installed, f"not installed: {sorted(expected - installed)}"
    assert not any(p.startswith(("autograd/", "comm/")) for p in installed)
