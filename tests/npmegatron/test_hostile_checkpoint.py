"""Checkpoints that lie (issue 26): every manifest field is checked before it is used and before
any shard is opened; a lie is one sentence (InputError), never a traceback, a file opened outside
the checkpoint folder, a half-loaded model or a silently different one."""
import copy
import hashlib
import json
import math
import os
import shutil

import numpy as np
import pytest
from hypothesis import strategies as st
from safetensors.numpy import load_file, save_file

from hostile import BUDGETS, check_property, one_sentence, opened_paths
from npmegatron.autograd import InputError
from npmegatron.comm import ProcessGrid
from npmegatron.model import GPT
from npmegatron.checkpointing import checkpoint, reshard
from npmegatron.training import TrainConfig, train
from npmegatron.optim.adamw import AdamW

SHARD = "mp_rank_00_000.safetensors"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A trained two-layer checkpoint: the folder that holds `latest` (read-only for the tests)."""
    root = tmp_path_factory.mktemp("hostile") / "ck"
    config = TrainConfig.from_flat(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                                   micro_batch_size=2, train_iters=2, lr_warmup_iters=1, eval_iters=1,
                                   sample_tokens=0, dtype="float64", fp16=False, save=str(root))
    train(config, echo=lambda *a: None)
    return root


def fresh_copy(saved, tmp_path, name="ck"):
    target = tmp_path / name
    shutil.copytree(saved, target, ignore=shutil.ignore_patterns(".npmegatron.lock"))
    return target, target / "iter_0000002"


def edit_manifest(iteration, change):
    path = iteration / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


def loaded_model(folder):
    """Load `folder` into a model of the saved shape; (model, its parameters before the load)."""
    _, manifest = checkpoint.read_manifest(str(folder))
    model = GPT(checkpoint.saved_config(manifest))
    before = [p.data.copy() for p in model.parameters()]
    checkpoint.load(str(folder), model, AdamW(model.parameters()), ProcessGrid.single())
    return model, before


def saved_model(saved):
    model = GPT(checkpoint.saved_config(checkpoint.read_manifest(str(saved))[1]))
    return model, [p.data.copy() for p in model.parameters()]


# ---- the traversal that resharding re-opened ----------------------------------------------------

def test_a_shard_name_that_climbs_out_is_refused_before_anything_outside_is_opened(saved, tmp_path, monkeypatch):
    root, iteration = fresh_copy(saved, tmp_path / "inside")
    outside = root.parent / "x.safetensors"          # where iter_0000002/../../x.safetensors leads
    shutil.copy(iteration / SHARD, outside)          # a valid shard, so only the name can stop it
    edit_manifest(iteration, lambda m: m.update(shards={"../../x.safetensors": m["shards"][SHARD]}))
    config = TrainConfig.from_flat(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                                   micro_batch_size=2, train_iters=3, lr_warmup_iters=1, eval_iters=1,
                                   sample_tokens=0, dtype="float64", load=str(root))
    opened = opened_paths(monkeypatch, reshard)
    with opened.recording(), pytest.raises(InputError) as error:
        train(config, echo=lambda *a: None)
    assert "'shards' names '../../x.safetensors', which is not a shard file name" in one_sentence(error.value)
    assert os.path.realpath(outside) not in opened.paths
    assert not [p for p in opened.outside(root) if p.endswith(".safetensors")]


# ---- one named case per lie ---------------------------------------------------------------------

def _link_shard_outside(root, iteration, tmp_path):
    shutil.move(iteration / SHARD, tmp_path / "elsewhere.safetensors")
    os.symlink(tmp_path / "elsewhere.safetensors", iteration / SHARD)


def _link_iteration_outside(root, iteration, tmp_path):
    shutil.move(iteration, tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", iteration)


def _shard_in_float16(root, iteration, tmp_path):
    tensors = {k: v.astype(np.float16) for k, v in load_file(str(iteration / SHARD)).items()}
    save_file(tensors, str(iteration / SHARD))
    data = (iteration / SHARD).read_bytes()
    edit_manifest(iteration, lambda m: m["shards"][SHARD].update(
        bytes=len(data), sha256=hashlib.sha256(data).hexdigest()))


def _manifest(change):
    return lambda root, iteration, tmp_path: edit_manifest(iteration, change)


def _place(name, value):
    return _manifest(lambda m: m["shards"][SHARD]["places"].__setitem__(name, value))


LIES = [
    pytest.param(_manifest(lambda m: m.update(shards={"/tmp/x.safetensors": m["shards"][SHARD]})),
                 "'shards' names '/tmp/x.safetensors', which is not a shard file name", id="shard-absolute"),
    pytest.param(_manifest(lambda m: m.update(shards={"sub/" + SHARD: m["shards"][SHARD]})),
                 "'shards' names 'sub/mp_rank_00_000.safetensors'", id="shard-separator"),
    pytest.param(_manifest(lambda m: m.update(shards={"model.safetensors": m["shards"][SHARD]})),
                 "'shards' names 'model.safetensors', which is not a shard file name", id="shard-foreign-name"),
    pytest.param(_manifest(lambda m: m["shards"].update({"mp_rank_01_000.safetensors": m["shards"][SHARD]})),
                 "mp_rank_01_000.safetensors is extra", id="shard-not-of-layout"),
    pytest.param(_link_shard_outside, "leads outside the checkpoint folder", id="shard-symlink-out"),
    pytest.param(_link_iteration_outside, "leads outside the checkpoint folder", id="iteration-symlink-out"),
    pytest.param(_manifest(lambda m: m.update(iteration=-2)), "'iteration' is -2", id="iteration-negative"),
    pytest.param(_manifest(lambda m: m.update(iteration="2")), "'iteration' is '2'", id="iteration-string"),
    pytest.param(_manifest(lambda m: m.update(iteration=7)), "'iteration' is 7, but its folder is iter_0000002",
                 id="iteration-not-its-folder"),
    pytest.param(_manifest(lambda m: m["model"].update(hidden_size="32")), "model hidden_size is '32'",
                 id="model-field-type"),
    pytest.param(_manifest(lambda m: m["model"].update(num_layers=0)), "model num_layers is 0", id="model-range"),
    pytest.param(_manifest(lambda m: m["model"].update(num_attention_heads=5)),
                 "hidden size 32 is not divisible by 5 attention heads", id="model-cli-check"),
    pytest.param(_manifest(lambda m: m["model"].update(hidden_dropout=float("nan"))),
                 "model hidden_dropout is nan", id="model-nan"),
    pytest.param(_manifest(lambda m: m["model"].pop("vocab_size")), "'model' has no 'vocab_size' entry",
                 id="model-missing-field"),
    pytest.param(_manifest(lambda m: m.update(grid={"tp": 0, "pp": 1, "dp": 1})), "grid tp is 0",
                 id="grid-zero"),
    pytest.param(_manifest(lambda m: m.update(grid=[1, 1, 1])), "'grid' is [1, 1, 1]", id="grid-type"),
    pytest.param(_place("wpe", [[0, 16], [0, 64]]), "places parameter wpe at [[0, 16], [0, 64]], outside its shape",
                 id="place-outside-parameter"),
    pytest.param(_place("wpe", [[0, 16]]), "places parameter wpe with 1 axes, but it has 2", id="place-axes"),
    pytest.param(_place("wpe", [[8, 4], [0, 32]]), "the place of wpe in shard", id="place-reversed"),
    pytest.param(_place("wpe", [[0, 8], [0, 32]]), "tensor model.wpe has shape [16, 32], but the manifest",
                 id="place-not-the-tensor"),
    pytest.param(_manifest(lambda m: m["shards"][SHARD]["places"].pop("ln_f.bias")),
                 "does not hold all of parameter ln_f.bias", id="place-missing"),
    pytest.param(_shard_in_float16, "tensor model.wpe has dtype F16, but the saver writes only F32 or F64",
                 id="shard-dtype"),
    pytest.param(_manifest(lambda m: m["shards"][SHARD].update(bytes=-1)), "shard mp_rank_00_000.safetensors bytes is -1",
                 id="shard-bytes"),
    pytest.param(_manifest(lambda m: m["shards"][SHARD].update(sha256=None)), "sha256 is None", id="shard-sha256"),
    pytest.param(_manifest(lambda m: m.update(run_id=["x"])), "'run_id' is ['x']", id="run-id"),
    pytest.param(_manifest(lambda m: m["ranks"][0]["rng"].update(iteration=-1)), "ranks[0] rng iteration is -1",
                 id="rng-negative"),
    pytest.param(_manifest(lambda m: m["ranks"][0].update(rng="seed")), "ranks[0] rng is 'seed'", id="rng-type"),
    pytest.param(_manifest(lambda m: m.update(ranks=[])), "'ranks' is []", id="ranks-count"),
    pytest.param(_manifest(lambda m: m.update(loss_scale={"scale": 0})), "loss_scale scale is 0", id="loss-scale-zero"),
    pytest.param(_manifest(lambda m: m.update(loss_scale={"scale": 8.0, "good_steps": "1"})),
                 "loss_scale good_steps is '1'", id="loss-scale-counts"),
    pytest.param(_manifest(lambda m: m["optimizer"].update(step=-1)), "optimizer step is -1", id="optimizer-step"),
    pytest.param(_manifest(lambda m: m["optimizer"].update(betas=[0.9])), "optimizer betas is [0.9]",
                 id="optimizer-betas"),
    pytest.param(_manifest(lambda m: m["data"].update(global_batch_size="2")), "data global_batch_size is '2'",
                 id="data-batch"),
    pytest.param(_manifest(lambda m: m.update(tokenizer={"type": "sentencepiece"})), "tokenizer type is 'sentencepiece'",
                 id="tokenizer-type"),
    pytest.param(_manifest(lambda m: m["args"].update(seq_length=0)), "args seq_length is 0", id="args-seq-length"),
    pytest.param(_manifest(lambda m: m.update(expert_bias={"blocks.0.mlp.router": ["0"]})),
                 "the expert bias of blocks.0.mlp.router is ['0']", id="expert-bias"),
    pytest.param(_manifest(lambda m: m["grid"].update(ep=2)), "one shard per TP, PP and EP rank", id="grid-ep"),
    pytest.param(lambda root, iteration, tmp_path: (iteration / "manifest.json").write_text("[1, 2]"),
                 "the manifest is [1, 2], but it must be a JSON object", id="manifest-not-object"),
]


@pytest.mark.parametrize("lie,message", LIES)
def test_each_lie_is_one_sentence_and_leaves_the_model_untouched(saved, tmp_path, lie, message):
    root, iteration = fresh_copy(saved, tmp_path)
    lie(root, iteration, tmp_path)
    model, before = saved_model(saved)
    with pytest.raises(InputError) as error:
        _, manifest = checkpoint.read_manifest(str(root))
        checkpoint.load(str(root), model, AdamW(model.parameters()), ProcessGrid.single())
    assert message in one_sentence(error.value)
    assert all(np.array_equal(p.data, b) for p, b in zip(model.parameters(), before))


def test_the_untouched_copy_loads(saved, tmp_path):
    root, _ = fresh_copy(saved, tmp_path)
    model, before = loaded_model(root)
    assert not all(np.array_equal(p.data, b) for p, b in zip(model.parameters(), before))


# ---- mutations of a valid manifest, generated ---------------------------------------------------

HOSTILE_STRINGS = ["../x.safetensors", "/etc/passwd", "mp_rank_00_000.safetensors/..", "", "iter_0000002",
                   "mp_rank_99_999.safetensors", "\x00", "nan"]
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.sampled_from([0, 1, -1, 2 ** 63])
    | st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(HOSTILE_STRINGS) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6)


def _paths(value, prefix=()):
    """Every key path in a JSON value (dict keys and list indices), the value's own () first."""
    yield prefix
    if isinstance(value, dict):
        for key, inner in value.items():
            yield from _paths(inner, prefix + (key,))
    elif isinstance(value, list):
        for i, inner in enumerate(value):
            yield from _paths(inner, prefix + (i,))


def _mutated(manifest, path, how, value):
    result = copy.deepcopy(manifest)
    if not path:
        return value
    parent = result
    for key in path[:-1]:
        parent = parent[key]
    key = path[-1]
    if how == "delete":
        del parent[key]
    elif how == "rename" and isinstance(parent, dict):
        parent[value if isinstance(value, str) else json.dumps(value)] = parent.pop(key)
    else:
        parent[key] = value
    return result


@pytest.mark.parametrize("examples", BUDGETS)
def test_mutated_manifests_load_or_are_refused_in_one_sentence(saved, tmp_path_factory, examples, monkeypatch):
    base = tmp_path_factory.mktemp("fuzz")
    manifest = json.loads((saved / "iter_0000002" / "manifest.json").read_text())
    paths = list(_paths(manifest))
    model, before = saved_model(saved)
    opened = opened_paths(monkeypatch, reshard)
    counter = iter(range(10 ** 9))

    def check(case):
        path, how, value = case
        root = base / f"case{next(counter)}"
        shutil.copytree(saved, root, ignore=shutil.ignore_patterns(".npmegatron.lock"))
        text = json.dumps(_mutated(manifest, path, how, value))
        (root / "iter_0000002" / "manifest.json").write_text(text)
        for p, b in zip(model.parameters(), before):
            p.data[...] = b
        with opened.recording():
            try:
                checkpoint.load(str(root), model, AdamW(model.parameters()), ProcessGrid.single())
            except InputError as error:
                one_sentence(error)
                assert all(np.array_equal(p.data, b) for p, b in zip(model.parameters(), before))
        assert not opened.outside(root), opened.outside(root)
        shutil.rmtree(root)

    cases = st.tuples(st.sampled_from(paths), st.sampled_from(["replace", "delete", "rename"]), JSON_VALUES)
    check_property(cases, check, examples)


@pytest.mark.parametrize("examples", BUDGETS)
def test_damaged_manifest_bytes_are_refused_in_one_sentence(saved, tmp_path_factory, examples):
    base = tmp_path_factory.mktemp("bytes")
    raw = (saved / "iter_0000002" / "manifest.json").read_bytes()
    model, _ = saved_model(saved)
    counter = iter(range(10 ** 9))

    def check(case):
        cut, offset, noise = case
        root = base / f"case{next(counter)}"
        shutil.copytree(saved, root, ignore=shutil.ignore_patterns(".npmegatron.lock"))
        data = bytearray(raw[:max(1, int(len(raw) * cut))])
        data[offset % len(data):offset % len(data) + len(noise)] = noise
        (root / "iter_0000002" / "manifest.json").write_bytes(bytes(data))
        try:
            checkpoint.load(str(root), model, AdamW(model.parameters()), ProcessGrid.single())
        except InputError as error:
            one_sentence(error)
        shutil.rmtree(root)

    check_property(st.tuples(st.floats(0, 1), st.integers(0, 2 ** 20), st.binary(max_size=8)), check, examples)


def test_a_checkpoint_that_names_its_grid_layout_still_loads(saved, tmp_path):
    """Earlier versions wrote the saving grid's shape under "layout"."""
    root, iteration = fresh_copy(saved, tmp_path)
    edit_manifest(iteration, lambda m: m.update(layout=m.pop("grid")))
    model, before = loaded_model(root)
    assert not all(np.array_equal(p.data, b) for p, b in zip(model.parameters(), before))


def test_a_nan_in_json_is_caught_as_a_lie_not_a_number(saved, tmp_path):
    root, iteration = fresh_copy(saved, tmp_path)
    edit_manifest(iteration, lambda m: m.update(loss_scale={"scale": math.inf}))
    with pytest.raises(InputError, match="loss_scale scale is inf"):
        checkpoint.read_manifest(str(root))
