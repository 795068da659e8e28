"""One distribution, three import names: npmegatron, npmegatron.autograd, npmegatron.comm.

The autograd/ and comm/ folders are mapped under npmegatron (package_dir) and never installed as
top-level `autograd` or `comm`: those names belong to HIPS autograd and Jupyter's comm.
The package list is found, not written by hand: a hand-written list once left out
npmegatron.tensor_parallel and npmegatron.pipeline, which only an editable install hid.
"""
from setuptools import find_packages, setup


def mapped_packages(folder):
    """The packages of a top-level folder installed as npmegatron.<folder> (package_dir below)."""
    return [f"npmegatron.{folder}"] + [f"npmegatron.{folder}.{p}" for p in find_packages(folder)]


setup(
    name="npmegatron",
    version="0.1.0",
    description="Megatron-LM's model parallelism rebuilt on NumPy and CuPy, with its own autograd",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=(find_packages(include=["npmegatron", "npmegatron.*"])
              + mapped_packages("autograd") + mapped_packages("comm")),
    package_dir={"npmegatron": "npmegatron", "npmegatron.autograd": "autograd",
                 "npmegatron.comm": "comm"},
    install_requires=[
        "numpy>=1.24",
        "scipy>=1.10",          # erf for the exact GeLU
        "mpi4py>=4.0",          # finds MPI in the environment (the mpich wheel, or a system MPI)
        "click>=8.0",
        "tqdm>=4.60",
        "threadpoolctl>=3.0",
        "safetensors>=0.4",     # checkpoints (never pickle)
        "matplotlib>=3.5",      # bench scaling's plots (Agg backend)
        "numba>=0.59",          # the dropout hash on the CPU: 24x NumPy's uint64 passes (measured)
        "pyyaml>=6.0",          # --config files in YAML (TOML and JSON need nothing)
        "tensorboardX>=2.6",    # --tensorboard-dir (event files without torch or tensorflow)
    ],
    extras_require={
        "mpi": ["mpich"],               # MPI itself from PyPI; leave out on clusters with a system MPI
        "hf": ["tokenizers>=0.15"],     # a local Hugging Face tokenizer.json for preprocess
        # ml_dtypes: the bfloat16 reference; hypothesis: the hostile-file tests; import-linter: the layers
        # tensorboard and wandb: their own readers check what --tensorboard-dir and --wandb-project wrote
        # cuda-bindings, nvidia-cuda-nvrtc-cu12 and nvidia-cuda-runtime-cu12 (its headers): NVRTC without
        # a GPU, compiling every CUDA source for sm_80 and sm_90 (tests/test_cuda_sources_compile.py);
        # CUDA 12, the gpu extra's (about 100 MB of wheels)
        "test": ["pytest>=7", "tokenizers>=0.15", "ml_dtypes>=0.3", "hypothesis>=6.80", "import-linter>=2.1",
                 "tensorboard>=2.10", "wandb>=0.16", "cuda-bindings>=12.9,<13", "nvidia-cuda-nvrtc-cu12>=12.9,<13",
                 "nvidia-cuda-runtime-cu12>=12.9,<13"],
        "wandb": ["wandb>=0.16"],                 # --wandb-project
        # Intel MKL for the CPU's Linear GEMMs (autograd/cpu_blas.py): PyTorch's CPU BLAS, faster than
        # NumPy's OpenBLAS on some CPUs and slower on others (2026.2 the release tested)
        "mkl": ["mkl>=2026.2"],
        # cupy-cuda13x for CUDA 13. CuPy pinned to the versions whose NCCL API comm uses (13: the
        # unique id is a tuple, 14: bytes; comm passes it through unchanged); libnccl itself does
        # not come with CuPy's wheel, and without it cupy.cuda.nccl imports but is unavailable.
        # ml_dtypes: bfloat16 arrays in CuPy 14 (--bf16 keeps float32 arrays under CuPy 13).
        # nvidia-cudnn-frontend: cuDNN's flash attention (1.13: `generate_stats`; 1.16 ran on an H200,
        # later releases rewrote the graph API in Python), with cuDNN itself for CUDA 12; without them
        # attention runs the blockwise path (fused_attention.py).
        # nvmath-python: cuBLASLt's GEMM epilogues (bias, bias + GeLU, GeLU's derivative; 1.0 the API
        # epilogues.py calls), over CUDA 12's cuda-bindings and the CUDA toolkit's cuBLAS, as CuPy's;
        # without it the same numbers come from kernels (epilogues.py)
        "gpu": ["cupy-cuda12x>=13,<15", "nvidia-nccl-cu12", "ml_dtypes>=0.3",
                "nvidia-cudnn-frontend>=1.13,<1.17", "nvidia-cudnn-cu12>=9.5",
                "nvmath-python>=1.0,<2", "cuda-bindings>=12.9,<13"],
    },
    entry_points={"console_scripts": ["npmegatron=npmegatron.cli:main"]},
    # the machine profiles of `npmegatron plan --profile NAME`, shipped in the wheel
    package_data={"npmegatron.perf": ["profiles/*.json"]},
)
