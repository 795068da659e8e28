"""The model's Linear GEMMs with their operands in cache, as `bench step`'s ceiling times them (the
same operands three times, the best kept), and with the operands evicted first, as a training
step meets them: its weights and saved activations were last touched a layer or a step before.
The products are gemm.matmul's, so on the BLAS the step uses (MKL with the `mkl` extra; set
NPMEGATRON_CPU_BLAS=openblas to time NumPy's OpenBLAS instead).

For each shape of the ceiling's rounds (npmegatron/bench/step.py `model_gemms`, the Linears'
forward shapes and both backward ones) it alternates a warm call, a pass that writes --evict-mib
MiB, and a cold call, and prints the medians and the cold call's extra time; the last line is
the total of a step's Linear GEMMs both ways. Run it as bench step, e.g.

    python scripts/bench_cold_gemm.py --threads 2 --model gpt2-124m
"""
import argparse
import statistics
import time

# npmegatron before NumPy: it sets OpenBLAS's idle threads to sleep (npmegatron/__init__.py)
from npmegatron.autograd import cpu_blas, gemm
from npmegatron.bench.step import model_gemms
from npmegatron.config import MODEL_PRESETS
from npmegatron.model import GPTConfig
import numpy
from threadpoolctl import threadpool_limits


def timed(a, b, out):
    start = time.perf_counter()
    gemm.matmul(a, b, out=out)
    return time.perf_counter() - start


def warm_and_cold(m, k, n, evict, repeats):
    """Median seconds of a (m, k) @ (k, n) float32 GEMM with its operands in cache and evicted."""
    rng = numpy.random.default_rng(0)
    a, b = rng.random((m, k), numpy.float32), rng.random((k, n), numpy.float32)
    out = numpy.empty((m, n), numpy.float32)
    warm, cold = [], []
    for _ in range(repeats):
        timed(a, b, out)
        warm.append(timed(a, b, out))
        evict += 1.0                     # every cache line of `evict` written: a, b and out leave the caches
        cold.append(timed(a, b, out))
    return statistics.median(warm), statistics.median(cold)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODEL_PRESETS), default="gpt2-124m")
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--evict-mib", type=int, default=600)
    args = parser.parse_args()
    preset = dict(MODEL_PRESETS[args.model])
    seq = preset.pop("seq_length")
    cfg = GPTConfig(max_position_embeddings=seq, hidden_dropout=0.0, attention_dropout=0.0, **preset)
    evict = numpy.ones(args.evict_mib << 18, numpy.float32)
    totals = [0.0, 0.0]
    with threadpool_limits(args.threads):
        for count, m, k, n, kind in model_gemms(cfg, args.micro_batch_size, seq):
            if kind != "matmul":
                continue
            for shape in ((m, k, n), (m, n, k), (k, m, n)):
                warm, cold = warm_and_cold(*shape, evict, args.repeats)
                totals[0] += count * warm
                totals[1] += count * cold
                print(f"{str(shape):>20}  x{count:<3} warm {warm * 1e3:7.2f} ms  cold {cold * 1e3:7.2f} ms  "
                      f"({(cold / warm - 1) * 100:+.1f} %)")
    print(f"a step's Linear GEMMs on {cpu_blas.name()}: warm {totals[0] * 1e3:.0f} ms, cold "
          f"{totals[1] * 1e3:.0f} ms ({(totals[1] / totals[0] - 1) * 100:+.1f} %)")


if __name__ == "__main__":
    main()
