"""Resharding on load (checkpointing/reshard.py): a checkpoint saved at one layout resumes at another
(TP, PP, DP, pipeline layout, distributed optimizer or not) on the losses of an uninterrupted run,
to 1e-12 relative in float64 with dropout off; generation loads any checkpoint at any layout."""

import numpy as np
import pytest

from helpers import launch_logged

RUN = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
       "--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", "20", "--log-interval", "1",
       "--eval-interval", "20", "--eval-iters", "1", "--lr-warmup-iters", "2", "--dtype", "float64",
       "--hidden-dropout", "0", "--attention-dropout", "0", "--sample-tokens", "0"]


def train(tmp_path, name, ranks, extra):
    return np.array([r["loss"] for r in launch_logged(ranks, RUN + extra, tmp_path / f"{name}.jsonl", timeout=600)])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return train(tmp_path_factory.mktemp("whole"), "whole", 0, [])


def resumed(tmp_path, saved_ranks, saved, loaded_ranks, loaded):
    first = train(tmp_path, "first", saved_ranks, saved + ["--save", str(tmp_path / "ck"), "--exit-interval", "10"])
    second = train(tmp_path, "second", loaded_ranks, loaded + ["--load", str(tmp_path / "ck")])
    return np.concatenate([first, second])


def assert_close(got, want, rel=1e-12):
    assert got.shape == want.shape == (20,)
    assert np.abs(got - want).max() <= rel * np.abs(want).max(), np.abs(got - want).max()


CASES = [
    (2, ["--tp", "2"], 0, []),                                                        # TP 2 -> serial
    pytest.param(2, ["--pp", "2"], 2, ["--pp", "2", "--pipeline-model-parallel-layout", "Ettt|tL"],
                 marks=pytest.mark.slow),                                             # another layout
    pytest.param(2, ["--use-distributed-optimizer"], 2, ["--tp", "2"], marks=pytest.mark.slow),  # ZeRO -> TP 2
    pytest.param(8, ["--tp", "2", "--pp", "2"], 0, [], marks=pytest.mark.slow),
    pytest.param(8, ["--tp", "2", "--pp", "2"], 8, ["--tp", "4"], marks=pytest.mark.slow),   # vocab padding 256 -> 512
    pytest.param(8, ["--tp", "2", "--pp", "2"], 2, ["--pp", "2", "--pipeline-model-parallel-layout", "Et|tttL"],
                 marks=pytest.mark.slow),
    pytest.param(8, ["--tp", "2", "--pp", "2", "--use-distributed-optimizer"], 4,
                 ["--tp", "2", "--use-distributed-optimizer"], marks=pytest.mark.slow),
    pytest.param(4, ["--pp", "2", "--num-layers-per-virtual-pipeline-stage", "1"], 0, [], marks=pytest.mark.slow),
]


@pytest.mark.parametrize("saved_ranks, saved, loaded_ranks, loaded", CASES,
                         ids=["tp2-to-serial", "pp2-to-other-layout", "zero-dp2-to-tp2", "tp2pp2dp2-to-serial",
                              "tp2pp2dp2-to-tp4dp2", "tp2pp2dp2-to-pp2-layout", "zero-tp2pp2dp2-to-zero-tp2dp2",
                              "interleaved-to-serial"])
def test_a_checkpoint_resumes_at_another_layout(tmp_path, uninterrupted, saved_ranks, saved, loaded_ranks, loaded):
    assert_close(resumed(tmp_path, saved_ranks, saved, loaded_ranks, loaded), uninterrupted)


@pytest.mark.slow
def test_use_checkpoint_args_resumes_from_load_alone(tmp_path, uninterrupted):
    """The second run names no model flag: layers, hidden size, heads and --seq-length come from
    the checkpoint."""
    shape, training = RUN[:8], RUN[8:]
    assert shape[::2] == ["--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length"]
    first = train(tmp_path, "first", 0, ["--save", str(tmp_path / "ck"), "--exit-interval", "10"])
    second = launch_logged(0, training + ["--load", str(tmp_path / "ck"), "--use-checkpoint-args"],
                           tmp_path / "second.jsonl")
    assert_close(np.concatenate([first, [r["loss"] for r in second]]), uninterrupted)


def test_use_checkpoint_args_needs_load():
    from npmegatron.autograd import InputError
    from npmegatron.training import TrainConfig
    with pytest.raises(InputError, match="--use-checkpoint-args reads the model's arguments from the checkpoint"):
        TrainConfig.from_flat(use_checkpoint_args=True)
