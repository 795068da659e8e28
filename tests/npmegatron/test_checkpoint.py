"""Checkpoints on one rank: bitwise resume, what the manifest holds, and every way a
checkpoint can be bad reported in one sentence naming the file."""
import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file

from npmegatron.autograd import InputError
from npmegatron.training import TrainConfig, train


def small(tmp_path, **kw):
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=32, micro_batch_size=4,
                global_batch_size=8, train_iters=20, lr=3e-3, lr_warmup_iters=3, log_interval=5,
                eval_interval=10, eval_iters=1, hidden_dropout=0.1, attention_dropout=0.1,
                sample_tokens=0)
    base.update(kw)
    return TrainConfig.from_flat(**base)


def shard_tensors(folder):
    latest = (folder / "latest").read_text()
    return load_file(str(folder / latest / "mp_rank_00_000.safetensors"))


@pytest.mark.quick_variants("float32")
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_resume_is_bitwise_identical_with_dropout(tmp_path, dtype):
    straight = train(small(tmp_path, dtype=dtype, save=str(tmp_path / "a")), echo=lambda *a: None)
    first = train(small(tmp_path, dtype=dtype, save=str(tmp_path / "b"), exit_interval=10),
                  echo=lambda *a: None)
    resumed = train(small(tmp_path, dtype=dtype, load=str(tmp_path / "b"), save=str(tmp_path / "c")),
                    echo=lambda *a: None)
    assert first == straight[:10]
    assert resumed == straight[10:]                       # bitwise: == on floats
    a, c = shard_tensors(tmp_path / "a"), shard_tensors(tmp_path / "c")
    assert a.keys() == c.keys() and any(k.startswith("exp_avg.") for k in a)
    for key in a:
        assert a[key].dtype == np.dtype(dtype) and np.array_equal(a[key], c[key]), key


def test_manifest_holds_config_layout_optimizer_rng_and_data_position(tmp_path):
    train(small(tmp_path, train_iters=4, save=str(tmp_path / "ck"), save_interval=2), echo=lambda *a: None)
    assert (tmp_path / "ck" / "latest").read_text() == "iter_0000004"
    assert sorted(os.listdir(tmp_path / "ck")) == [".npmegatron.lock", "iter_0000002", "iter_0000004", "latest"]
    m = json.loads((tmp_path / "ck" / "iter_0000004" / "manifest.json").read_text())
    assert m["iteration"] == 4 and m["model"]["hidden_size"] == 32
    assert m["grid"] == {"tp": 1, "pp": 1, "dp": 1}
    assert m["optimizer"]["step"] == 4
    assert m["data"]["consumed_samples"] == 32 and m["data"]["global_batch_size"] == 8
    assert set(m["ranks"][0]["rng"]) == {"iteration", "micro_batch"}     # stateless dropout: a position
    shard = m["shards"]["mp_rank_00_000.safetensors"]
    assert len(shard["sha256"]) == 64 and shard["bytes"] > 0


def corrupt(folder, how):
    it = folder / open(folder / "latest").read()
    shard = it / "mp_rank_00_000.safetensors"
    if how == "truncated":
        shard.write_bytes(shard.read_bytes()[:-100])
    elif how == "flipped":
        data = bytearray(shard.read_bytes())
        data[-5] ^= 0xFF
        shard.write_bytes(bytes(data))
    elif how == "manifest":
        (it / "manifest.json").write_text("{not json")
    elif how == "no-shard":
        shard.unlink()
    return it


@pytest.mark.quick_variants(first=2)
@pytest.mark.parametrize("how,message", [
    ("truncated", "checkpoint shard {it}/mp_rank_00_000.safetensors has {n} bytes but the manifest says"),
    ("flipped", "checkpoint shard {it}/mp_rank_00_000.safetensors fails its SHA-256 check"),
    ("manifest", "checkpoint manifest {it}/manifest.json is not valid JSON"),
    ("no-shard", "checkpoint shard {it}/mp_rank_00_000.safetensors is missing"),
])
def test_corrupt_checkpoint_is_one_sentence_naming_the_file(tmp_path, how, message):
    train(small(tmp_path, train_iters=2, save=str(tmp_path / "ck")), echo=lambda *a: None)
    size = os.path.getsize(tmp_path / "ck" / "iter_0000002" / "mp_rank_00_000.safetensors")
    it = corrupt(tmp_path / "ck", how)
    with pytest.raises(InputError) as error:
        train(small(tmp_path, train_iters=4, load=str(tmp_path / "ck")), echo=lambda *a: None)
    assert message.format(it=it, n=size - 100) in str(error.value)


def test_mismatched_or_missing_checkpoint(tmp_path):
    train(small(tmp_path, train_iters=2, save=str(tmp_path / "ck")), echo=lambda *a: None)
    with pytest.raises(InputError, match="holds a model with hidden_size 32, but this run has "
                                         "hidden_size 64; pass the saved run's model flags"):
        train(small(tmp_path, hidden_size=64, load=str(tmp_path / "ck")), echo=lambda *a: None)
    with pytest.raises(InputError, match="trained with global batch 8, this run has 16"):
        train(small(tmp_path, global_batch_size=16, load=str(tmp_path / "ck")), echo=lambda *a: None)
    # a --load folder with no checkpoint yet (missing, or empty): the run starts from scratch,
    # so one job script serves the first run and every requeue
    fresh = train(small(tmp_path, train_iters=2), echo=lambda *a: None)
    said = []
    assert train(small(tmp_path, train_iters=2, load=str(tmp_path / "nothing")), echo=said.append) == fresh
    assert any("--load " + str(tmp_path / "nothing") + " holds no checkpoint yet: training starts from scratch"
               in line for line in said), said
    os.makedirs(tmp_path / "empty")
    assert train(small(tmp_path, train_iters=2, load=str(tmp_path / "empty")), echo=lambda *a: None) == fresh


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_nan_loss_stops_with_the_iteration_and_keeps_the_last_checkpoint(tmp_path):
    # lr 1e30 blows the float32 weights up after the first step; the loss turns nan at step 2.
    with pytest.raises(InputError) as error:
        train(small(tmp_path, lr=1e30, min_lr=0, lr_warmup_iters=0, clip_grad=0, hidden_dropout=0,
                    attention_dropout=0, train_iters=10, save=str(tmp_path / "ck"), save_interval=1),
              echo=lambda *a: None)
    text = str(error.value)
    assert "became nan at iteration 2" in text or "became inf at iteration 2" in text, text
    assert f"the last checkpoint (iteration 1 in {tmp_path / 'ck'}) is untouched" in text
    assert (tmp_path / "ck" / "latest").read_text() == "iter_0000001"
    # and that checkpoint still loads and verifies (iteration 1 of 1: nothing left to train)
    assert train(small(tmp_path, train_iters=1, load=str(tmp_path / "ck")), echo=lambda *a: None) == []


def test_saving_an_iteration_again_keeps_the_old_copy_until_the_new_is_in_place(tmp_path):
    train(small(tmp_path, train_iters=2, save=str(tmp_path / "ck")), echo=lambda *a: None)
    # a kill between moving the old copy aside and renaming the new one in leaves only .old
    os.rename(tmp_path / "ck" / "iter_0000002", tmp_path / "ck" / "iter_0000002.old")
    assert train(small(tmp_path, train_iters=2, load=str(tmp_path / "ck")), echo=lambda *a: None) == []
    train(small(tmp_path, train_iters=2, save=str(tmp_path / "ck")), echo=lambda *a: None)
    assert sorted(os.listdir(tmp_path / "ck")) == [".npmegatron.lock", "iter_0000002", "latest"]


def test_checkpoint_args_of_a_manifest_from_before_the_model_families():
    """A manifest without the Llama-family fields is GPT-2's: --use-checkpoint-args takes its heads,
    and the key/value groups follow them (they are not this run's resolved default)."""
    from npmegatron.config import TrainConfig
    config = TrainConfig.from_flat(load="ck", use_checkpoint_args=True)
    old = {"model": {"num_layers": 2, "hidden_size": 768, "num_attention_heads": 12, "vocab_size": 256,
                     "max_position_embeddings": 128, "ffn_hidden_size": 3072}, "args": {"seq_length": 128}}
    model = config.with_checkpoint_args(old).model
    assert (model.num_attention_heads, model.num_query_groups, model.normalization) == (12, 12, "LayerNorm")
    llama = TrainConfig.from_flat(load="ck", use_checkpoint_args=True, model_family="llama")
    assert llama.with_checkpoint_args(old).model.normalization == "LayerNorm"     # the checkpoint's model
