"""The multi-rank harness: run a rank program (a module under tests/ranks/) on N ranks by spawning
`mpiexec -n N` (this pytest process never initialises MPI), with a timeout so a hang fails the
test, and every rank's output shown on failure. The helpers behind it (and those test modules
share: mpiexec_path, rank_environment, launch) live in tests/helpers.py."""
import compileall
import os
import sys

import pytest

from npmegatron.autograd import bf16_bits, cublas_capture, epilogues, fusion, sixteen_bit_kernels, row_kernels  # first: npmegatron sets the BLAS threads before NumPy loads
from npmegatron.autograd.ops import arithmetic, fused_attention  # noqa: E402
from fakes.strict_cupy import strict_cupy  # noqa: E402
from helpers import ROOT, run_ranks  # noqa: E402

#: The source folders whose modules every spawned rank and command imports.
SOURCE_FOLDERS = ("npmegatron", "autograd", "comm", "scripts", "tests")


def pytest_configure(config):
    """Where Python may not write bytecode (PYTHONDONTWRITEBYTECODE), each of the suite's hundreds
    of spawned ranks and commands would compile this project's modules from source again (a
    quarter of a second each): compile them once, into the __pycache__ folders Python reads
    (ignored by git, as Python itself would write them without that setting). This process
    writes its own from here on: pytest reads the test modules it rewrote for their asserts from
    bytecode it wrote, and rewrites all of them again (4.5 s) when it may not write."""
    if sys.flags.dont_write_bytecode:
        for folder in SOURCE_FOLDERS:
            compileall.compile_dir(os.path.join(ROOT, folder), quiet=1)
        sys.dont_write_bytecode = False


@pytest.fixture
def mpirun():
    """mpirun(n, module, args=(), timeout=120, env=None, check=True) -> MPIResult.

    Runs `mpiexec -n n python tests/<module> <args...>` from the repository root, e.g.
    mpirun(4, "ranks/collectives.py", args=["world"]); `args` are turned into strings. `env`
    adds to the rank environment (one BLAS thread per rank, throttled MPICH polling). With
    check=True a non-zero exit fails the test with every rank's output; a run past `timeout`
    seconds is killed (mpiexec and every rank) and fails the test."""
    return run_ranks


@pytest.fixture
def fresh_strict_cupy(monkeypatch):
    """The strict CuPy stand-in on one device, counters reset, every fused chain compiled afresh
    (a kernel made under another test's stand-in is forgotten)."""
    for chain in fusion.CHAINS.values():
        monkeypatch.setattr(chain, "_kernel", None)
    for kernel in row_kernels.KERNELS.values():
        monkeypatch.setattr(kernel, "_compiled", {})
    for kernel in bf16_bits.KERNELS.values():
        monkeypatch.setattr(kernel, "_compiled", None)
    monkeypatch.setattr(sixteen_bit_kernels, "_compiled", {})
    for cache in ("_libraries", "_graphs", "_handles"):      # cuDNN's handles and graphs of another stand-in
        monkeypatch.setattr(fused_attention, cache, {})
    monkeypatch.setattr(cublas_capture, "_apis", {})           # another stand-in's C API and workspaces
    monkeypatch.setattr(cublas_capture, "_workspaces", {})
    # nvmath's stand-in and its plans, and arrays kept per CuPy module, of another stand-in
    for module, cache in ((epilogues, "_libraries"), (epilogues, "_plans"), (epilogues, "unsupported"),
                          (arithmetic, "_constants")):
        monkeypatch.setattr(module, cache, {})
    with strict_cupy(devices=1) as module:
        module._strict.reset()
        yield module


def pytest_collection_modifyitems(items):
    """`@pytest.mark.quick_variants(id, ..., first=N)` on a parametrized test: the quick run
    (-m "not slow") keeps the cases with those ids and the first N; the other cases are marked
    slow, and the whole suite runs them. For sweeps whose cases take the same path (one bad input
    after another, a repetition against a race) or repeat a lighter case at more ranks."""
    for item in items:
        keep = item.get_closest_marker("quick_variants")
        if keep is None or not hasattr(item, "callspec"):
            continue
        position = max(item.callspec.indices.values())
        if item.callspec.id not in keep.args and position >= keep.kwargs.get("first", 0):
            item.add_marker(pytest.mark.slow)
