"""--cuda-graph (npmegatron/training/cuda_graph.py) on the strict CuPy stand-in, whose capture runs
nothing and refuses what CUDA refuses (a host synchronisation, upload or read, an allocation from a
pool that is not stream-ordered, work on another stream) and whose replay runs the captured calls
again with the scalars they had and the arrays as they hold now: a replayed step is bitwise the
eager step, and from the host's view a step is one graph launch (and the uploads of its batch and
scalars), with one synchronisation."""
import collections
import json

import numpy
import pytest
from fakes.strict_cupy import strict_cupy_env

from npmegatron.autograd import InputError
from npmegatron.training import TrainConfig
from npmegatron.training.trainer import Trainer

SMALL = dict(device="gpu", num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, micro_batch_size=2,
             global_batch_size=4, lr=3e-3, lr_warmup_iters=2, train_iters=7, log_interval=1, eval_interval=100,
             eval_iters=1, sample_tokens=0, hidden_dropout=0.0, attention_dropout=0.0, cuda_graph_warmup_steps=2)


@pytest.fixture
def cp(fresh_strict_cupy):
    return fresh_strict_cupy


def run(cp, steps, **options):
    """(losses, norms, parameters, launch kinds and syncs of each step) of a trainer's steps."""
    trainer = Trainer(TrainConfig.from_flat(**{**SMALL, **options}))
    losses, norms, per_step = [], [], []
    for _ in range(steps):
        cp._strict.reset()
        loss, norm, _ = trainer.step()
        counters = cp._strict.counters()
        per_step.append((collections.Counter(launch.kind for launch in cp._strict.launches()),
                         counters["sync"], counters["upload"]))
        losses.append(loss)
        norms.append(norm)
    return losses, norms, [cp.asnumpy(p.data) for p in trainer.params], per_step, trainer


@pytest.mark.quick_variants("float32")
@pytest.mark.parametrize("options", [{}, {"bf16": True}, {"hidden_dropout": 0.1, "attention_dropout": 0.1}],
                         ids=["float32", "bf16", "dropout"])
def test_replayed_steps_equal_eager_ones_bitwise_one_launch_a_step(cp, options):
    """Two micro-batches a step (gradient accumulation), clipping on: steps 1-2 eager, step 3
    captured and run, 4-7 replayed, against seven steps without the flag; with dropout, each
    replay draws its iteration's masks (keyed on the device), the eager run's."""
    eager = run(cp, 7, **options)
    graphed = run(cp, 7, cuda_graph=True, **options)
    assert graphed[4].graphed.graph is not None
    assert graphed[0] == eager[0] and graphed[1] == eager[1]
    for mine, theirs in zip(graphed[2], eager[2]):
        numpy.testing.assert_array_equal(mine, theirs)
    for kinds, syncs, uploads in graphed[3][3:]:
        # one graph launch; uploaded: the batch's ids and targets (2 micro-batches), the
        # optimizer's scalars and the iteration; read: the loss and the norm, together
        assert kinds == {"graph": 1} and uploads == 6 and syncs == 1, (kinds, uploads, syncs)
    assert sum(eager[3][-1][0].values()) > 100        # what the host launches itself without the graph


def test_capture_refuses_what_cuda_refuses(cp):
    x = cp.ones(4, cp.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        with pytest.raises(cp._strict.StreamCaptureError, match="default memory pool"):
            x * 2                           # later arrays would be given the graph's memory
        stream.end_capture()
    cp.cuda.set_allocator(cp.cuda.MemoryAsyncPool().malloc)
    try:
        for refused, match in ((lambda: float(x.sum()), "host sync"), (lambda: cp.asarray(numpy.ones(2)), "upload"),
                               (lambda: x.get(), "host sync")):
            with stream:
                stream.begin_capture()
                with pytest.raises(cp._strict.StreamCaptureError, match=match):
                    refused()
                stream.end_capture()
        with stream:
            stream.begin_capture()
        with pytest.raises(cp._strict.StreamCaptureError, match="outside the graph"):
            x + 1                                            # on the null stream while `stream` captures
        with stream:
            stream.end_capture()
        # a stream forked from the capture must be joined back before it ends
        other = cp.cuda.Stream(non_blocking=True)
        with stream:
            stream.begin_capture()
            other.wait_event(stream.record())
        with other:
            x * 3
        with pytest.raises(cp._strict.StreamCaptureError, match="Unjoined"):
            stream.end_capture()
        # captured work runs only when launched, on the arrays' values then
        with stream:
            stream.begin_capture()
            y = x * 2
            x += y
            graph = stream.end_capture()
        assert cp.asnumpy(x).tolist() == [1.0] * 4
        with stream:
            graph.launch(stream)
            graph.launch(stream)
        assert cp.asnumpy(x).tolist() == [9.0] * 4 and cp.asnumpy(y).tolist() == [6.0] * 4
    finally:
        cp.cuda.set_allocator(None)


def test_graph_memory_comes_from_a_pool_of_its_own(cp):
    """With the stream-ordered pool, CUDA refuses a free inside the capture of memory allocated
    before it (cudaFreeAsync: cudaErrorInvalidValue); a caching pool of the graph's own frees on
    the host, and once it has served a capture it may serve nothing outside one."""
    stream = cp.cuda.Stream(non_blocking=True)
    try:
        for pool in (cp.cuda.MemoryAsyncPool(), cp.cuda.MemoryPool()):
            cp.cuda.set_allocator(pool.malloc)
            before, dropped = cp.ones(4, cp.float32), cp.ones(4, cp.float32)
            with stream:
                stream.begin_capture()
                after = before * 2
                del dropped                 # as a step replaces an array made before it
                if isinstance(pool, cp.cuda.MemoryAsyncPool):
                    with pytest.raises(cp._strict.StreamCaptureError, match="freed during it"):
                        stream.end_capture()
                    continue
                graph = stream.end_capture()
            with pytest.raises(cp._strict.StreamCaptureError, match="replays would write over it"):
                cp.zeros(2)
            cp.cuda.set_allocator(None)
            cp.zeros(2)
            with stream:
                graph.launch(stream)
            assert cp.asnumpy(after).tolist() == [2.0] * 4
    finally:
        cp.cuda.set_allocator(None)


@pytest.mark.slow
@pytest.mark.parametrize("options", [
    {"tensor_model_parallel_size": 2, "sequence_parallel": True, "hidden_dropout": 0.1, "attention_dropout": 0.1},
    {}, {"use_distributed_optimizer": True, "bf16": True},
], ids=["tp2-sp-dropout", "dp2", "dp2-distributed-optimizer-bf16"])
def test_collectives_are_captured_across_ranks(mpirun, options):
    """Two ranks, a GPU each, so NCCL: tensor parallelism's all-reduces and reduce-scatters, the
    data-parallel buckets' all-reduces on their own stream (forked from the capturing stream and
    joined back) and the distributed optimizer's gathers replay with the graph, bitwise the eager
    steps (tests/ranks/cuda_graph_training.py)."""
    result = mpirun(2, "ranks/cuda_graph_training.py", args=[json.dumps(options)], timeout=300,
                    env=strict_cupy_env(devices=2))
    record = json.loads(result.stdout.strip().splitlines()[-1])
    assert record["replayed_launches"] == [{"graph": 1}] * 4, record


@pytest.mark.slow
def test_ranks_sharing_a_gpu_are_refused(mpirun):
    result = mpirun(2, "ranks/cuda_graph_training.py", args=[json.dumps({"expect_refusal": True})], timeout=300,
                    env=strict_cupy_env(devices=1))
    assert "give each rank a GPU of its own" in json.loads(result.stdout.strip().splitlines()[-1])["refused"]


@pytest.mark.parametrize("options, why", [
    ({"device": "cpu"}, "the device is cpu"),
    ({"fp16": True, "loss_scale": 128.0}, "loss scaling"),
    ({"bf16": True, "loss_scale": 128.0}, "loss scaling"),
    ({"pipeline_model_parallel_size": 2}, "use --pp 1"),
    ({"context_parallel_size": 2}, "use --cp 1"),
])
def test_what_a_graph_cannot_hold_is_refused_in_one_sentence(options, why):
    with pytest.raises(InputError, match=f"--cuda-graph cannot be used here: .*{why}"):
        TrainConfig.from_flat(**{**SMALL, "cuda_graph": True, **options})
