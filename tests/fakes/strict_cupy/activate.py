"""Putting the strict CuPy stand-in in front of any installed CuPy.

The folder also holds `cudnn`, a stand-in for nvidia-cudnn-frontend's graph API (cudnn/__init__.py),
and `nvmath`, one for nvmath-python's cuBLASLt matrix multiplication with epilogues.

In-process:

    from fakes.strict_cupy import strict_cupy
    with strict_cupy(devices=2) as cupy:      # also STRICT_CUPY_DEVICES=2 for the block
        ...                                   # `import cupy` anywhere now gets the stand-in

For rank programs under mpiexec: pass env=strict_cupy_env() (PYTHONPATH with the stand-in
first) to the mpirun fixture / helpers.run_ranks."""
import contextlib
import importlib
import os
import sys

_PACKAGES = ("cupy", "cupyx", "cudnn", "nvmath")


def strict_cupy_path():
    """The folder to put first on sys.path / PYTHONPATH (it holds `cupy` and `cupyx`)."""
    return os.path.dirname(os.path.abspath(__file__))


def strict_cupy_env(devices=None, extra=None):
    """Environment additions for a subprocess: PYTHONPATH with the stand-in first, and
    STRICT_CUPY_DEVICES when `devices` is given."""
    paths = [strict_cupy_path()] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {"PYTHONPATH": os.pathsep.join(paths)}
    if devices is not None:
        env["STRICT_CUPY_DEVICES"] = str(devices)
    env.update(extra or {})
    return env


def _ours(name):
    return name in _PACKAGES or name.startswith(tuple(p + "." for p in _PACKAGES))


@contextlib.contextmanager
def strict_cupy(devices=None):
    """Within the block `import cupy`/`cupyx` give the stand-in, freshly imported (fresh
    counters and device state); any CuPy imported before is hidden, and restored after, with
    sys.path and STRICT_CUPY_DEVICES. Yields the stand-in's `cupy` module.

    Modules imported inside the block that kept a reference to the stand-in keep it; code that
    does `import cupy` when it runs (as npmegatron does) sees whichever is in sys.modules."""
    saved_modules = {name: mod for name, mod in sys.modules.items() if _ours(name)}
    saved_path = list(sys.path)
    saved_env = os.environ.get("STRICT_CUPY_DEVICES")
    for name in saved_modules:
        del sys.modules[name]
    sys.path.insert(0, strict_cupy_path())
    if devices is not None:
        os.environ["STRICT_CUPY_DEVICES"] = str(devices)
    importlib.invalidate_caches()
    try:
        import cupy
        if not os.path.abspath(cupy.__file__).startswith(strict_cupy_path() + os.sep):
            raise ImportError(f"`import cupy` gave {cupy.__file__}, not the strict stand-in")
        yield cupy
    finally:
        for name in [n for n in sys.modules if _ours(n)]:
            del sys.modules[name]
        sys.modules.update(saved_modules)
        sys.path[:] = saved_path
        if saved_env is None:
            os.environ.pop("STRICT_CUPY_DEVICES", None)
        else:
            os.environ["STRICT_CUPY_DEVICES"] = saved_env
