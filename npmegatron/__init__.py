"""npmegatron: Megatron-LM (Shoeybi et al., 2019) rebuilt on NumPy and CuPy.

`npmegatron.autograd` is the tensor engine, `npmegatron.comm` the communication layer, and this
package the model-parallel library on top: GPT-2, training, benchmarks and the CLI.
"""
import os as _os

# OpenBLAS's idle worker threads spin for 2**28 cycles (about 0.1 s) after every GEMM, so the
# LayerNorm, GeLU or attention that follows a GEMM shares its cores with them: measured 2048 x 512
# by 512 x 2048 float32 GEMM then GeLU on 2 cores, 62 ms, against 48 ms when they sleep after 2**12
# cycles (the GEMM alone unchanged, 29 ms). OpenBLAS reads this once, when NumPy loads it: it
# works where npmegatron is imported before NumPy (the CLI, scripts/train.py, mpirun ranks).
_os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "12")
# numba's kernels (LayerNorm, the dropout hash) run on OpenMP threads, which by default spin after
# each kernel and so take a core from the GEMM that follows; the LayerNorm kernels last about a
# millisecond, so sleeping costs them nothing (reference model, 4 alternating pairs: 3 faster).
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"

from .autograd.host_memory import keep_freed_memory as _keep_freed_memory  # noqa: E402

_keep_freed_memory()
