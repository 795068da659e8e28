"""One forward and backward of a 2-layer GPT at TP 2 with dropout, with and without sequence
parallelism (without it the column-parallel Linears all-reduce their input's gradient during the
weight GEMMs), under --bf16 and --fp16 on the strict CuPy stand-in (its folder first on
PYTHONPATH): with the GPU's 16-bit arrays, and with float32 arrays on the 16-bit grid. Rank 0
prints one JSON line: per format and layout, whether the loss and every gradient are bitwise
equal, and the parameters' dtypes each way.

    mpiexec -n 2 python tests/ranks/sixteen_bit_tensor_parallel.py
"""
import json

import numpy as np

from npmegatron import comm
from npmegatron.autograd import backward, precision
from npmegatron.autograd.backend import to_numpy
from npmegatron.config import TrainConfig
from npmegatron.run import assemble


def one_pass(fmt, sixteen_bit_arrays, sequence_parallel):
    precision.sixteen_bit_arrays_on_gpu = sixteen_bit_arrays
    config = TrainConfig.from_flat(
        device="gpu", num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=96, seq_length=32,
        micro_batch_size=2, tensor_model_parallel_size=2, sequence_parallel=sequence_parallel, hidden_dropout=0.1,
        attention_dropout=0.1, dtype="float32", lr=1e-4, **{fmt: True})
    run = assemble(config, world_size=2)
    ids = np.random.default_rng(7).integers(0, 96, (2, 33))
    _, loss = run.model.chunks[0](ids[:, :-1], ids[:, 1:])
    backward(loss)
    return (to_numpy(loss.data), [to_numpy(p.grad) for p in run.params],
            sorted({str(p.data.dtype) for p in run.params}))


def main():
    world = comm.init()
    report = {}
    for fmt in ("bf16", "fp16"):
        for sp in (True, False):
            (loss, grads, dtypes), (loss_apart, grads_apart, dtypes_apart) = (one_pass(fmt, on, sp) for on in (True, False))
            equal = bool(np.array_equal(loss, loss_apart) and all(np.array_equal(a, b) for a, b in zip(grads, grads_apart)))
            report[fmt + ("-sp" if sp else "")] = {"bitwise_equal": equal, "dtypes": dtypes, "dtypes_apart": dtypes_apart}
    if world.rank == 0:
        print(json.dumps(report))


if __name__ == "__main__":
    main()
