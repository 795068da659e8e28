"""Tensor and sequence parallelism equal the serial model (float64, under mpiexec), with the
paper's communication counts, Megatron's cross-entropy values and the RNG-tracker semantics."""
import json

import pytest

RANKS = "ranks/tensor_parallel.py"


def test_mappings_are_adjoint_pairs(mpirun):
    """<y, F(x)> = <F*(y), x>, where F* is F's backward. Replicated spaces (R) count once;
    distributed ones (D: per-rank copies or shards) sum over ranks."""
    mpirun(4, RANKS, args=["adjoint"])


@pytest.mark.quick_variants("2")
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tensor_parallel_equals_serial(mpirun, tp):
    result = mpirun(tp, RANKS, args=["equals-serial"], timeout=180)
    reports = [json.loads(l) for l in result.stdout.splitlines() if l.startswith("{")]
    assert [r["sp"] for r in reports] == [False, True]
    assert reports[0]["padded_vocab"] == 128 * tp


def test_compiled_float32_loss_with_extreme_shards(mpirun):
    """Shards whose row is all -inf, or far below another shard's maximum, give the full
    vocabulary's loss and gradient, without a NumPy warning (ranks/tensor_parallel.py)."""
    result = mpirun(2, RANKS, args=["cross-entropy-extreme-shards"], timeout=120)
    assert "extreme shards ok" in result.stdout


def test_tensor_parallel_with_the_compiled_loss_equals_serial(mpirun):
    result = mpirun(2, RANKS, args=["equals-serial-compiled-loss"], timeout=180)
    reports = [json.loads(l) for l in result.stdout.splitlines() if l.startswith("{")]
    assert [r["sp"] for r in reports] == [False, True]


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_through_shared_memory_equals_serial(mpirun, tp):
    """Activations of 64 KiB take comm's shared-memory all-reduce (comm/shared_memory.py)."""
    result = mpirun(tp, RANKS, args=["equals-serial-shared-memory"], timeout=180)
    report = json.loads(next(l for l in result.stdout.splitlines() if l.startswith("{")))
    assert report["shared_memory_calls"] >= 8 and report["max_rel_error"] < 1e-10


def test_communication_per_layer_matches_the_paper(mpirun):
    result = mpirun(2, RANKS, args=["counts"])
    reports = {r["sp"]: r for r in (json.loads(l) for l in result.stdout.splitlines() if l.startswith("{"))}
    # paper Fig. 4: two all-reduces forward (g after attention and MLP) and two backward (f)
    assert reports[False]["per_layer"] == {"all_reduce": [2, 2], "all_gather": [0, 0], "reduce_scatter": [0, 0]}
    # sequence parallel: each all-reduce becomes a reduce-scatter + all-gather pair
    assert reports[True]["per_layer"] == {"all_reduce": [0, 0], "all_gather": [2, 2], "reduce_scatter": [2, 2]}
    # outside the layers: the embedding's g, the output layer's f and the loss's 3 all-reduces
    assert reports[False]["one_layer_model"]["all_reduce"] == [2 + 1 + 3, 2 + 1]


def test_cross_entropy_communication_does_not_grow_with_the_vocabulary(mpirun):
    result = mpirun(2, RANKS, args=["cross-entropy-volume"])
    assert "volumes" in result.stdout


def test_megatron_cross_entropy_reference_values(mpirun):
    """Megatron's unit test: on 4 ranks the local logits are arange(8) repeated to 32 columns
    (vocabulary 128); 16 tokens with targets 0, 2, ..., 30."""
    result = mpirun(4, RANKS, args=["megatron-cross-entropy"])
    assert "megatron values ok" in result.stdout


def test_dropout_masks_follow_the_rng_tracker(mpirun):
    """Residual/embedding dropout masks are identical across TP ranks; attention-probability
    masks (different heads per rank) differ. The masks are read off the autograd tape."""
    result = mpirun(2, RANKS, args=["dropout-masks"])
    assert "masks ok" in result.stdout


def test_sequence_parallel_cuts_layernorm_and_dropout_tape_bytes(mpirun):
    result = mpirun(4, RANKS, args=["tape-bytes"])
    report = json.loads(next(l for l in result.stdout.splitlines() if l.startswith("{")))
    assert report["with_sp"]["LayerNorm"] * 4 == pytest.approx(report["without_sp"]["LayerNorm"], rel=0.1)


def test_heads_not_divisible_by_tp_and_vocab_shards_are_clear_errors():
    from npmegatron.autograd import InputError
    from npmegatron.comm import Group
    from npmegatron.model import GPT, GPTConfig
    from npmegatron.tensor_parallel import VocabParallelEmbedding, pad_vocab_size
    import numpy as np
    assert pad_vocab_size(50257, 8) == 51200
    assert pad_vocab_size(256, 1) == 256 and pad_vocab_size(256, 4) == 512
    with pytest.raises(InputError, match="^make_vocab_size_divisible_by 0 must be a positive integer$"):
        pad_vocab_size(256, 1, 0)

    class FakeGroup(Group):        # a 6-rank group, enough to build layers without MPI
        def __init__(self, size):
            self.name, self.mpi, self.ranks, self.rank, self.size, self.nccl = "tp", None, tuple(range(size)), 0, size, None

    class Grid:
        tp_group = FakeGroup(6)
        tp_rank = 0
    with pytest.raises(InputError, match="32 attention heads are not divisible by tensor-parallel size 6"):
        GPT(GPTConfig(hidden_size=64, num_attention_heads=32), Grid())
    with pytest.raises(InputError, match="padded vocabulary size 100 is not divisible by the tensor-parallel size 6"):
        VocabParallelEmbedding(np, np.float64, 100, 100, 8, 0.02, FakeGroup(6))

    class SequenceParallelGrid:
        tp_group, tp_rank, pp_rank = FakeGroup(2), 0, 0
    model = GPT(GPTConfig(num_layers=1, hidden_size=16, num_attention_heads=2, max_position_embeddings=8,
                          sequence_parallel=True), SequenceParallelGrid())
    with pytest.raises(InputError, match="sequence length 3 is not divisible by the tensor-parallel size 2, "
                       "as sequence parallelism needs; use a multiple of it$"):
        model(np.zeros((1, 3), int))
