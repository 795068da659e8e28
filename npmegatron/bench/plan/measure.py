"""This machine's rates for `plan`'s work model (perf/work.py), measured in this process with a
given number of threads (BLAS through threadpoolctl, the CPU engine through its budget):

- GEMM FLOP/s of gemm.matmul over a grid of shapes, rows x cols x inner each in GEMM_DIMS;
- the blockwise attention kernel's seconds per computed score, forward and backward, with and
  without dropout, by sequence length and head size;
- memory bandwidth by array size: of a NumPy add split in row blocks over the threads as the
  CPU engine splits its chains ("stream"), and of the engine's own LayerNorm, bias-GeLU,
  bias-dropout-add, embedding lookup and vocabulary-parallel cross-entropy forward and backward
  (their bytes, perf/work.PASSES, over their seconds); and of AdamW's update, for the optimizer;
- the engine's seconds per layer and per micro-batch: forward and backward of a GPT so small
  that its arithmetic takes no time, with 1 and with 5 layers;
- how much slower than their share processes run when twice as many as the cores share them.
Every figure is the best of a few repeats after a warm-up."""
import os
import subprocess
import sys
import time

import numpy
from threadpoolctl import threadpool_limits

from ... import autograd as ag
from ...autograd.cpu_blocks import for_row_blocks
from ...autograd.gemm import matmul
from ...autograd.profile import op_profile
from ...autograd.threads import set_cpu_threads
from ...comm import ProcessGrid, blas_thread_environment
from ...config import GPTConfig
from ...model import GPT
from ...optim.adamw import AdamW
from ...perf.work import attention_scores, op_bytes
from ...tensor_parallel import MODEL_PARALLEL, RNGTracker, VocabParallelEmbedding, vocab_parallel_cross_entropy

GEMM_DIMS = (64, 256, 1024, 4096)
ATTENTION_SEQS = (128, 256, 512, 1024)
ATTENTION_HEAD_DIMS = (32, 64, 128)
ATTENTION_SCORES = 1 << 23           # scores per measurement: samples x heads chosen to reach it


def best_seconds(run, repeats=3):
    run()                               # warm: BLAS threads, first-touch pages
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def gemm_table(dtype):
    """FLOP/s indexed [rows][cols][inner] over GEMM_DIMS."""
    table = []
    for m in GEMM_DIMS:
        table.append([])
        for n in GEMM_DIMS:
            row = []
            for k in GEMM_DIMS:
                a, b = numpy.full((m, k), 0.5, dtype), numpy.full((k, n), 0.25, dtype)
                out = numpy.empty((m, n), dtype)
                repeats = 2 if m * n * k >= 1 << 32 else 3
                row.append(2.0 * m * n * k / best_seconds(lambda: matmul(a, b, out=out), repeats))
            table[-1].append(row)
    return {"dims": list(GEMM_DIMS), "flops": table}


def attention_table(dtype):
    """Seconds per computed score (perf/work.attention_scores) of the blockwise attention
    kernel, forward and backward, with dropout 0.1 and without, [seq][head size]."""
    table = {"seqs": list(ATTENTION_SEQS), "head_dims": list(ATTENTION_HEAD_DIMS)}
    site = RNGTracker(1, 0, numpy).site(MODEL_PARALLEL, 1).frozen()
    for kind, p in (("none", 0.0), ("dropout", 0.1)):
        forward, backward = [], []
        for seq in ATTENTION_SEQS:
            forward.append([])
            backward.append([])
            for d in ATTENTION_HEAD_DIMS:
                heads = max(1, ATTENTION_SCORES // attention_scores(seq))
                qkv = numpy.random.default_rng(0).standard_normal((1, seq, heads, 3, d)).astype(dtype)
                grad = numpy.ones((1, heads, seq, d), dtype)

                def step():
                    x = ag.Tensor(qkv, requires_grad=True)
                    ag.causal_attention_packed(x, d ** -0.5, p, site if p else None).backward(grad)

                scores = heads * attention_scores(seq)
                seconds = op_seconds(step, "PackedCausalAttention")
                forward[-1].append(seconds[0] / scores)
                backward[-1].append(seconds[1] / scores)
        table[f"{kind}_forward"], table[f"{kind}_backward"] = forward, backward
    return table


BANDWIDTH_ELEMENTS = (1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24)
#: The engine's memory-bound ops timed by kind, and the width of the rows they run on.
OP_WIDTHS = {"norm": 768, "activation": 3072, "residual": 768, "embedding": 768, "loss": 8192}
OP_NAMES = {"norm": "LayerNorm", "activation": "BiasGelu", "residual": "BiasDropoutAdd", "embedding": "_ShardLookup",
            "loss": "_VocabParallelCrossEntropy"}


def bandwidth_tables(dtype):
    """{kind: {"elements", "bytes_per_s"}}: the blocked add ("stream") and each of the engine's
    memory-bound ops, forward and backward, their bytes (perf/work.PASSES) over their seconds,
    by array size: small arrays pay the hand-off to threads, large ones the memory's bandwidth."""
    tables = {"stream": [bandwidth(dtype, n) for n in BANDWIDTH_ELEMENTS]}
    w = numpy.dtype(dtype).itemsize
    for kind, width in OP_WIDTHS.items():
        tables[kind] = []
        for elements in BANDWIDTH_ELEMENTS:
            rows = max(1, elements // width)
            nbytes = sum(op_bytes(kind, rows * width, w, mask=kind == "residual"))
            tables[kind].append(nbytes / sum(op_seconds(op_step(kind, rows, width, dtype), OP_NAMES[kind])))
    return {kind: {"elements": list(BANDWIDTH_ELEMENTS), "bytes_per_s": rates} for kind, rates in tables.items()}


def bandwidth(dtype, elements=1 << 24):
    """Bytes per second a blocked NumPy add of arrays of `elements` numbers reads and writes."""
    a, b = numpy.full(elements, 1.0, dtype), numpy.full(elements, 2.0, dtype)
    out = numpy.empty_like(a)
    rows = elements // 1024
    a2, b2, out2 = a.reshape(rows, 1024), b.reshape(rows, 1024), out.reshape(rows, 1024)

    def add():
        for_row_blocks(rows, 1024, lambda i, j: numpy.add(a2[i:j], b2[i:j], out=out2[i:j]))

    return 3 * a.nbytes / best_seconds(add, repeats=5)


def op_seconds(step, name, repeats=5):
    """(forward, backward): the best seconds of the Function `name` in step() each way, timed by
    the op profile: the op alone, not the engine's handling of the leaf tensors the measurement
    feeds it (in a model its gradient flows on into the next op instead)."""
    best = [float("inf"), float("inf")]
    for i in range(repeats + 1):
        with op_profile() as table:
            step()
        if i:                           # the first warms threads and pages
            best = [min(b, t) for b, t in zip(best, table[name][:2])]
    return best


def op_step(kind, rows, width, dtype):
    """Forward and backward of one of the engine's memory-bound ops on (rows, width) arrays."""
    random = numpy.random.default_rng(0)
    x = random.standard_normal((rows, width)).astype(dtype)
    vector = ag.Tensor(random.standard_normal(width).astype(dtype), requires_grad=True)
    gain = ag.Tensor(numpy.ones(width, dtype), requires_grad=True)
    site = RNGTracker(1, 0, numpy).site(MODEL_PARALLEL, 2).frozen()
    residual = ag.Tensor(x.copy(), requires_grad=True)
    grad = numpy.ones((rows, width), dtype)
    group = ProcessGrid.single().tp_group
    embedding = VocabParallelEmbedding(numpy, dtype, 1024, 1024, width, 0.02, group)
    ids = random.integers(0, 1024, rows)

    def step():
        y = ag.Tensor(x, requires_grad=True)
        if kind == "norm":
            out = ag.layer_norm(y, gain, vector)
        elif kind == "activation":
            out = ag.bias_gelu(y, vector)
        elif kind == "residual":
            out = ag.bias_dropout_add(y, vector, residual, 0.1, site)
        elif kind == "embedding":
            out = embedding(ids)
        else:
            vocab_parallel_cross_entropy(y, ids % width, group).backward()
            return
        out.backward(grad)

    return step


OPTIMIZER_ELEMENTS = 1 << 24


def optimizer_bandwidth(dtype, elements=None):
    """Bytes per second AdamW's update reads and writes (28 a float32 parameter: the parameter,
    gradient and two moments read, three written; perf/time_model.optimizer_time) on one flat
    parameter, as training's buckets give it."""
    elements = elements or OPTIMIZER_ELEMENTS
    param = ag.Tensor(numpy.zeros(elements, dtype), requires_grad=True)
    param.grad = numpy.full(elements, 1e-3, dtype)
    optimizer = AdamW([param])
    return 28 * elements / best_seconds(optimizer.step, repeats=5)


def engine_overhead(dtype):
    """(seconds per layer, seconds per micro-batch) of forward + backward of a tiny GPT."""
    def step_seconds(layers):
        cfg = GPTConfig(num_layers=layers, hidden_size=8, num_attention_heads=1, vocab_size=16,
                        max_position_embeddings=8, dtype=dtype)
        model = GPT(cfg)
        ids = numpy.arange(8).reshape(1, 8) % 16

        def step():
            model.forward(ids, ids)[1].backward()

        return best_seconds(step, repeats=10)

    one, five = step_seconds(1), step_seconds(5)
    per_layer = max(0.0, (five - one) / 4)
    return per_layer, max(0.0, one - per_layer)


#: One process's share of the time-sliced work: a GEMM at a layer's shape and a blocked-size add.
SHARED_WORK = """
import sys, time
import numpy
a, b = numpy.ones((1024, 768), "float32"), numpy.ones((768, 3072), "float32")
x = numpy.ones(1 << 22, "float32")
a @ b
while time.time() < float(sys.argv[1]):
    time.sleep(0.001)
start = time.perf_counter()
for _ in range(int(sys.argv[2])):
    a @ b
    x + x
print(time.perf_counter() - start)
"""


def sharing_factor(cores, repeats=24, start_delay=1.0):
    """How much slower than their share of the cores processes run when there are twice as many
    as cores (time-slicing evicts each other's caches; a layout with more ranks than cores runs
    so): the slowest of 2 x cores one-thread processes working at once, over twice the slowest
    of `cores` such processes. 1 when nothing is lost."""
    def slowest(processes):
        start_at = str(time.time() + start_delay)      # after every process has imported NumPy
        env = dict(os.environ, **blas_thread_environment(1))
        children = [subprocess.Popen([sys.executable, "-c", SHARED_WORK, start_at, str(repeats)], env=env,
                                     stdout=subprocess.PIPE, text=True) for _ in range(processes)]
        return max(float(child.communicate()[0]) for child in children)

    return max(1.0, slowest(2 * cores) / (2 * slowest(cores)))


def measure(threads, dtype="float32"):
    """Every rate above with `threads` threads, as the profile's measured.threads entry."""
    previous = set_cpu_threads(threads)
    try:
        with threadpool_limits(limits=threads, user_api="blas"):
            per_layer, per_micro_batch = engine_overhead(dtype)
            return {"gemm": gemm_table(dtype), "attention": attention_table(dtype),
                    "bandwidth": bandwidth_tables(dtype), "bandwidth_bytes_per_s": optimizer_bandwidth(dtype),
                    "layer_overhead_s": per_layer, "micro_batch_overhead_s": per_micro_batch}
    finally:
        set_cpu_threads(previous)
