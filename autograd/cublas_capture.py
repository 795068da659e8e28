"""cuBLAS inside a CUDA graph capture (--cuda-graph, npmegatron/training/cuda_graph.py).

CuPy's cuBLAS bindings refuse every call while the current stream captures (their setStream raises
NotImplementedError, cupy_backends/cuda/libs/cublas.pyx), although cuBLAS itself can be captured
once the handle holds a workspace of the caller's (cuBLAS guide, "CUDA Graphs Support"); without
one a captured product may use workspace the graph does not own. So while a stream captures,
gemm.py calls the libcublas CuPy loaded, through ctypes, on CuPy's own handle: the stream set,
then a workspace of that stream's own, then the product, as PyTorch does. The next call CuPy makes
sets the stream again, which gives the handle back its default workspace. Outside a capture
nothing here runs."""
import ctypes
import os

import numpy

#: a handle's workspace in a capture: what cuBLAS asks for on Hopper (32 MiB; 4 MiB before it)
WORKSPACE_BYTES = 32 * 2 ** 20

#: id of the array module -> its cuBLAS C API
_apis = {}
#: (device, stream pointer) -> the workspace array, kept for as long as graphs may replay
_workspaces = {}

_HANDLE, _INT, _STRIDE, _POINTER = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong, ctypes.c_void_p
_PROTOTYPES = {
    "cublasSetStream_v2": [_HANDLE, _POINTER],
    "cublasSetWorkspace_v2": [_HANDLE, _POINTER, ctypes.c_size_t],
    # handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype, ldc,
    # compute type, algorithm
    "cublasGemmEx": [_HANDLE, _INT, _INT, _INT, _INT, _INT, _POINTER, _POINTER, _INT, _INT, _POINTER, _INT, _INT,
                     _POINTER, _POINTER, _INT, _INT, _INT, _INT],
    # the same with a stride after each matrix's leading dimension and the batch count before the
    # compute type
    "cublasGemmStridedBatchedEx": [_HANDLE, _INT, _INT, _INT, _INT, _INT, _POINTER, _POINTER, _INT, _INT, _STRIDE,
                                   _POINTER, _INT, _INT, _STRIDE, _POINTER, _POINTER, _INT, _INT, _STRIDE, _INT,
                                   _INT, _INT],
}


def capturing(xp):
    """Whether array module xp's current stream is capturing a graph."""
    return xp.cuda.get_current_stream().is_capturing()


def c_api(xp):
    """The cuBLAS C API for array module xp: the module's own where it carries one (the strict
    stand-in does), else the libcublas loaded in this process, to which CuPy's handles belong."""
    key = id(xp)
    if key not in _apis:
        _apis[key] = getattr(xp.cuda.cublas, "c_api", None) or _load(_loaded_library("libcublas.so"))
    return _apis[key]


def _loaded_library(prefix):
    """The path of the loaded shared library whose file name starts with `prefix`."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if os.path.basename(path).startswith(prefix):
                return path
    raise RuntimeError(f"{prefix} is not loaded in this process: --cuda-graph captures the GEMMs CuPy's "
                       "cuBLAS runs, so run a step before the capture (--cuda-graph-warmup-steps 1 or more)")


def _load(path):
    library = ctypes.CDLL(path)
    for name, argtypes in _PROTOTYPES.items():
        function = getattr(library, name)
        function.argtypes, function.restype = argtypes, ctypes.c_int
    return library


def workspace(xp):
    """The current stream's workspace (made on first use: call it before a capture begins)."""
    key = (xp.cuda.Device().id, xp.cuda.get_current_stream().ptr)
    if key not in _workspaces:
        _workspaces[key] = xp.empty(WORKSPACE_BYTES, numpy.uint8)
    return _workspaces[key]


def call(xp, handle, routine, *args):
    """cuBLAS `routine` ("cublasGemmEx" or "cublasGemmStridedBatchedEx") with `args` after the
    handle, on the current (capturing) stream, with the stream's workspace."""
    api = c_api(xp)
    _check(api.cublasSetStream_v2(handle, xp.cuda.get_current_stream().ptr), "cublasSetStream_v2")
    _check(api.cublasSetWorkspace_v2(handle, workspace(xp).data.ptr, WORKSPACE_BYTES), "cublasSetWorkspace_v2")
    _check(getattr(api, routine)(handle, *args), routine)


def _check(status, routine):
    if status != 0:
        raise RuntimeError(f"{routine} failed with cuBLAS status {status} while a CUDA graph was being captured")
