"""GPU arrays through comm: NCCL where each rank has a GPU, MPI staged through host memory where
ranks share one. Skips cleanly where no GPU is present."""
import pytest

cupy = pytest.importorskip("cupy")
try:
    GPUS = cupy.cuda.runtime.getDeviceCount()
except Exception:
    GPUS = 0
if GPUS < 1:
    pytest.skip("no CUDA device", allow_module_level=True)

RANKS = "ranks/comm_gpu.py"


def test_nccl_backend_on_a_one_rank_group(mpirun):
    mpirun(1, RANKS, args=["nccl"])


def test_two_ranks_on_one_gpu_stage_through_host(mpirun):
    mpirun(2, RANKS, args=["shared-gpu"])
