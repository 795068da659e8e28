"""GPT-2 124M's Linear GEMMs (1,024 tokens) and its attention's per-block GEMMs (128 queries, head
size 64, 1,024 keys) in NumPy's BLAS and in PyTorch's, alternating in one process on the same
threads: the ceiling each framework's CPU step stands on. Run with a Python that has numpy,
threadpoolctl and torch (`python scripts/bench_gemm_peer.py --threads 2`; attention's GEMMs run on
one thread per head in both frameworks, so compare those at `--threads 1`); prints one JSON line
per shape, GFLOP/s as the best of `--repeats` timings."""
import argparse
import json
import time

import numpy
import torch
from threadpoolctl import threadpool_info, threadpool_limits

#: (name, rows, inner, columns, second operand transposed) of the forward products: QKV,
#: projection, MLP in and out, the output layer; then a block of attention scores (q k^T, k read
#: transposed) and its rows (probabilities @ v)
SHAPES = (("qkv", 1024, 768, 2304, False), ("projection", 1024, 768, 768, False),
          ("mlp in", 1024, 768, 3072, False), ("mlp out", 1024, 3072, 768, False),
          ("output layer", 1024, 768, 50304, False),
          ("attention scores", 128, 64, 1024, True), ("attention rows", 128, 1024, 64, False))


def best_rate(product, flops, repeats):
    """FLOP/s of the fastest of `repeats` calls, after two untimed ones."""
    for _ in range(2):
        product()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        product()
        seconds.append(time.perf_counter() - start)
    return flops / min(seconds)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="BLAS threads for both (default 2)")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per shape and library")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    blas = [f"{lib['internal_api']} {lib['version']}" for lib in threadpool_info() if lib["user_api"] == "blas"]
    rng = numpy.random.default_rng(0)
    with threadpool_limits(args.threads, user_api="blas"):
        for name, m, k, n, transposed in SHAPES:
            a = rng.standard_normal((m, k), numpy.float32)
            b = rng.standard_normal((n, k) if transposed else (k, n), numpy.float32)
            b = b.T if transposed else b
            out = numpy.empty((m, n), numpy.float32)
            ta, tb, tout = torch.from_numpy(a), torch.from_numpy(b), torch.from_numpy(out)
            flops = 2 * m * k * n
            ours = best_rate(lambda: numpy.matmul(a, b, out=out), flops, args.repeats)
            theirs = best_rate(lambda: torch.mm(ta, tb, out=tout), flops, args.repeats)
            print(json.dumps({"gemm": name, "shape": [m, k, n], "threads": args.threads,
                              "numpy_gflops": round(ours / 1e9, 1), "torch_gflops": round(theirs / 1e9, 1),
                              "numpy_blas": blas, "torch": torch.__version__,
                              "torch_mkl": torch.backends.mkl.is_available()}))


if __name__ == "__main__":
    main()
