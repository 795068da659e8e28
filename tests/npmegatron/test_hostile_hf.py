"""Hugging Face folders that lie (issue 26): `convert --from-hf` checks config.json, the shard
index and every safetensors header before it trusts them, and `convert --to-hf` does not write
over another model. A lie is one sentence (InputError) naming the file or value and the fix,
never a traceback, a file opened outside the folder, or a silently different model."""
import json
import os
import shutil

import numpy as np
import pytest
from hypothesis import strategies as st
from safetensors.numpy import load_file, save_file

from hostile import BUDGETS, check_property, one_sentence, opened_paths
from npmegatron import hf_folder, safetensors_header
from npmegatron.autograd import InputError
from npmegatron.config import GPTConfig
from npmegatron.convert import (config_to_hf, export_hf, import_hf, masters_to_hf, name_map, read_hf_model,
                                write_hf_folder)

CFG = GPTConfig(num_layers=2, hidden_size=8, num_attention_heads=2, vocab_size=11,
                max_position_embeddings=6, dtype="float64")
WEIGHTS = "model.safetensors"
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
INDEX = "model.safetensors.index.json"


def hf_state(seed=0):
    """A random GPT-2 of CFG's shape in HF's layout ("transformer."-prefixed, QKV in HF's order)."""
    rng = np.random.default_rng(seed)
    return masters_to_hf({ours: rng.standard_normal(shape) for _, ours, shape in name_map(CFG)}, CFG)


def valid_folder(folder, seed=0):
    """A folder as save_pretrained writes it (config.json, model.safetensors), by the project's writer."""
    write_hf_folder(str(folder), config_to_hf(CFG), hf_state(seed))
    return folder


def sharded(folder):
    """The valid folder's weights split over two shards and an index, as save_pretrained writes a
    large model."""
    state = load_file(str(folder / WEIGHTS))
    os.remove(folder / WEIGHTS)
    names = sorted(state)
    parts = {SHARDS[0]: names[:12], SHARDS[1]: names[12:]}
    for shard, part in parts.items():
        save_file({k: state[k] for k in part}, str(folder / shard), metadata={"format": "pt"})
    write_json(folder / INDEX, {"metadata": {}, "weight_map": {k: s for s, part in parts.items() for k in part}})
    return folder


def write_json(path, value):
    path.write_text(json.dumps(value))


def split(path):
    """(header dict, data bytes) of a safetensors file."""
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + length]), raw[8 + length:]


def joined(header_text, data, length=None):
    """Safetensors bytes from a header's JSON text and data, with its true length unless told."""
    text = header_text.encode() if isinstance(header_text, str) else header_text
    return (len(text) if length is None else length).to_bytes(8, "little") + text + data


def last_tensor(header):
    """The name of the tensor whose bytes come last in the data area."""
    return max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])


# ---- one named case per lie: each damages a valid folder (tmp_path/hf) ---------------------------

def _config(change):
    def lie(folder, tmp_path):
        config = json.loads((folder / "config.json").read_text())
        change(config)
        write_json(folder / "config.json", config)
    return lie


def _config_text(text):
    def lie(folder, tmp_path):
        (folder / "config.json").write_bytes(text)
    return lie


def _weights(edit):
    """A lie in model.safetensors: edit(header, data) -> the file's new bytes."""
    def lie(folder, tmp_path):
        header, data = split(folder / WEIGHTS)
        (folder / WEIGHTS).write_bytes(edit(header, data))
    return lie


def _entry(change):
    """One header entry changed (the last tensor's unless change names another), the data kept."""
    def edit(header, data):
        extra = change(header, header[last_tensor(header)])
        return joined(json.dumps(header), data + (extra or b""))
    return _weights(edit)


def _remove(name):
    return lambda folder, tmp_path: os.remove(folder / name)


def _link_out(name):
    def lie(folder, tmp_path):
        shutil.move(folder / name, tmp_path / ("outside-" + name))
        os.symlink(tmp_path / ("outside-" + name), folder / name)
    return lie


def _shard_index(change):
    def lie(folder, tmp_path):
        sharded(folder)
        shutil.copy(folder / SHARDS[1], tmp_path / "x.safetensors")     # bait: a valid shard outside
        os.makedirs(folder / "sub")
        shutil.copy(folder / SHARDS[1], folder / "sub" / SHARDS[1])
        index = json.loads((folder / INDEX).read_text())
        change(index["weight_map"], tmp_path)
        write_json(folder / INDEX, index)
    return lie


def _repoint(value):
    """Every tensor of the second shard pointed at `value` (a callable of tmp_path, or a value)."""
    def change(weight_map, tmp_path):
        for key, shard in weight_map.items():
            if shard == SHARDS[1]:
                weight_map[key] = value(tmp_path) if callable(value) else value
    return change


def _shard_link_out(folder, tmp_path):
    sharded(folder)
    shutil.move(folder / SHARDS[1], tmp_path / "elsewhere.safetensors")
    os.symlink(tmp_path / "elsewhere.safetensors", folder / SHARDS[1])


def _tensor_in_both_shards(folder, tmp_path):
    """The first shard also holds a (different) copy of a tensor the index puts in the second."""
    sharded(folder)
    first, second = load_file(str(folder / SHARDS[0])), load_file(str(folder / SHARDS[1]))
    first["transformer.wte.weight"] = second["transformer.wte.weight"] + 1
    save_file(first, str(folder / SHARDS[0]), metadata={"format": "pt"})


def _state(change):
    def lie(folder, tmp_path):
        state = load_file(str(folder / WEIGHTS))
        change(state)
        save_file(state, str(folder / WEIGHTS), metadata={"format": "pt"})
    return lie


def _duplicate_name(header, data):
    """A header naming a tensor twice: json keeps the last silently, so the first is a lie."""
    name = last_tensor(header)
    text = json.dumps(header)
    return joined('{"%s": %s, ' % (name, json.dumps(header[name])) + text[1:], data)


def _longer_by(extra):
    """The last tensor's byte range `extra` bytes longer than its shape needs (and the file too)."""
    def change(header, entry):
        entry["data_offsets"][1] += extra
        return b"\0" * extra
    return change


def _shift_last(delta, grow=b""):
    def change(header, entry):
        entry["data_offsets"] = [entry["data_offsets"][0] + delta, entry["data_offsets"][1] + delta]
        return grow
    return _entry(change)


def _recast(dtype):
    """The last tensor's F64 bytes relabelled as another dtype, its shape sized to match them."""
    def change(header, entry):
        entry["dtype"] = dtype
        entry["shape"] = [int(np.prod(entry["shape"])) * 8 // {"I64": 8}[dtype]]
    return change


LIES = [
    pytest.param(_remove("config.json"), "config.json does not exist; a Hugging Face model folder holds",
                 id="hf-config-missing"),
    pytest.param(_config_text(b"{not json"), "config.json is not valid JSON", id="hf-config-not-json"),
    pytest.param(_config_text(b"\xff\xfe{}"), "config.json is not valid JSON", id="hf-config-not-utf8"),
    pytest.param(_config_text(b"[" * 100000), "config.json is not valid JSON", id="hf-config-nested-deep"),
    pytest.param(_config_text(b"[1, 2]"), "config.json holds a JSON list, not an object", id="hf-config-not-object"),
    pytest.param(_config(lambda c: c.update(n_layer="2")), "config.json has n_layer '2'; it must be a positive integer",
                 id="hf-config-n-layer-string"),
    pytest.param(_config(lambda c: c.update(n_embd=-1)), "config.json has n_embd -1; it must be a positive integer",
                 id="hf-config-n-embd-negative"),
    pytest.param(_config(lambda c: c.update(n_head=True)), "config.json has n_head True; it must be a positive integer",
                 id="hf-config-n-head-boolean"),
    pytest.param(_config(lambda c: c.update(n_head=3)), "config.json has n_head 3, which does not divide n_embd 8",
                 id="hf-config-n-head-not-dividing"),
    pytest.param(_config(lambda c: c.update(n_embd=10 ** 400)), "n_embd 1000000000000000000000000000000",
                 id="hf-config-int-beyond-float"),
    pytest.param(_config(lambda c: c.update(n_layer=10 ** 12)),
                 "config.json has n_layer 1000000000000, but the weights' layers are h.0, h.1 (2 in all)",
                 id="hf-config-n-layer-huge"),
    pytest.param(_config(lambda c: c.update(vocab_size=2 ** 40)),
                 "config.json has vocab_size 1099511627776, but tensor 'transformer.wte.weight' has shape (11, 8)",
                 id="hf-config-vocab-huge"),
    pytest.param(_config(lambda c: c.update(n_layer=3)),
                 "config.json has n_layer 3, but the weights' layers are h.0, h.1",
                 id="hf-config-n-layer-disagrees"),
    pytest.param(_config(lambda c: c.update(vocab_size=12)),
                 "config.json has vocab_size 12, but tensor 'transformer.wte.weight' has shape (11, 8)",
                 id="hf-config-vocab-disagrees"),
    pytest.param(_config(lambda c: c.update(n_positions=7)),
                 "config.json has n_positions 7, but tensor 'transformer.wpe.weight' has shape (6, 8)",
                 id="hf-config-positions-disagree"),
    pytest.param(_config(lambda c: c.update(n_inner=16)),
                 "config.json has n_inner (or 4 x n_embd) 16, but tensor 'transformer.h.0.mlp.c_fc.weight' has shape "
                 "(8, 32)", id="hf-config-inner-disagrees"),
    pytest.param(_config(lambda c: c.update(resid_pdrop="0.1")),
                 "config.json has resid_pdrop '0.1'; it must be a number in [0, 1)", id="hf-config-dropout-string"),
    pytest.param(_config(lambda c: c.update(layer_norm_epsilon=float("nan"))),
                 "config.json has layer_norm_epsilon nan; it must be a positive finite number",
                 id="hf-config-epsilon-nan"),
    pytest.param(_config(lambda c: c.update(activation_function=["gelu"])),
                 "config.json has activation_function ['gelu']; npmegatron supports", id="hf-config-activation-list"),
    pytest.param(_link_out("config.json"), "config.json leads outside", id="hf-config-symlink-out"),
    pytest.param(_remove(WEIGHTS), "model.safetensors does not exist; save the model with save_pretrained",
                 id="hf-weights-missing"),
    pytest.param(_link_out(WEIGHTS), "model.safetensors leads outside", id="hf-weights-symlink-out"),
    pytest.param(_weights(lambda h, d: b"\x01\x02\x03"), "cannot be read as safetensors: it holds 3 bytes, fewer than",
                 id="hf-st-shorter-than-length"),
    pytest.param(_weights(lambda h, d: joined(json.dumps(h), d, length=10 ** 9)),
                 "cannot be read as safetensors: its header length is 1000000000 bytes, but",
                 id="hf-st-length-past-end"),
    pytest.param(_weights(lambda h, d: joined(json.dumps(h), d, length=2 ** 64 - 1)),
                 "its header length is 18446744073709551615 bytes", id="hf-st-length-huge"),
    pytest.param(_weights(lambda h, d: joined(b"{not json", d)),
                 "cannot be read as safetensors: its header is not valid JSON",
                 id="hf-st-header-not-json"),
    pytest.param(_weights(lambda h, d: joined(b"[]", d)), "its header is a JSON list, not an object",
                 id="hf-st-header-not-object"),
    pytest.param(_weights(_duplicate_name), "its header names 'transformer.", id="hf-st-name-twice"),
    pytest.param(_entry(_longer_by(8)), "(712 bytes), but F64 of shape [11, 8] needs 704 bytes",
                 id="hf-st-offsets-size-lie"),
    pytest.param(_shift_last(-8), "which overlaps the tensor before it", id="hf-st-offsets-overlap"),
    pytest.param(_shift_last(8, b"\0" * 8), "which leaves bytes", id="hf-st-offsets-gap"),
    pytest.param(_entry(lambda h, e: e.update(data_offsets=[-8, 0])),
                 "but they must be [begin, end] with 0 <= begin <= end",
                 id="hf-st-offsets-negative"),
    pytest.param(_weights(lambda h, d: joined(json.dumps(h), d[:-8])), "data bytes follow the header (truncated",
                 id="hf-st-data-truncated"),
    pytest.param(_weights(lambda h, d: joined(json.dumps(h), d + b"\0" * 8)),
                 "data bytes follow the header (truncated, or bytes appended)",
                 id="hf-st-bytes-appended"),
    pytest.param(_entry(lambda h, e: e.update(shape=[-1, 8])), "but a shape is a list of non-negative integers",
                 id="hf-st-shape-negative"),
    pytest.param(_entry(lambda h, e: e.update(shape=[True] * len(e["shape"]))),
                 "a shape is a list of non-negative integers",
                 id="hf-st-shape-boolean"),
    pytest.param(_entry(lambda h, e: e.update(dtype="Q4")), "has dtype 'Q4', which is not a safetensors dtype",
                 id="hf-st-dtype-unknown"),
    pytest.param(_entry(_recast("I64")), "has dtype I64, but npmegatron reads F16, BF16, F32, F64 weights",
                 id="hf-st-dtype-int"),
    pytest.param(_entry(lambda h, e: h.update(__metadata__={"format": 1})), "its __metadata__ is {'format': 1}",
                 id="hf-st-metadata-not-strings"),
    pytest.param(_state(lambda s: s["transformer.wte.weight"].__setitem__((0, 0), np.nan)),
                 "tensor 'transformer.wte.weight' holds NaN or infinite values", id="hf-weights-nan"),
    pytest.param(_shard_index(_repoint("../x.safetensors")),
                 "in '../x.safetensors', which is not the name of a .safetensors file in the folder itself",
                 id="hf-index-parent"),
    pytest.param(_shard_index(_repoint(lambda tmp_path: str(tmp_path / "x.safetensors"))),
                 "which is not the name of a .safetensors file in the folder itself", id="hf-index-absolute"),
    pytest.param(_shard_index(_repoint("sub/" + SHARDS[1])), "in 'sub/model-00002-of-00002.safetensors', which is not",
                 id="hf-index-subfolder"),
    pytest.param(_shard_index(_repoint(3)), "in 3, which is not the name of a .safetensors file",
                 id="hf-index-not-text"),
    pytest.param(_shard_index(_repoint("x\x00.safetensors")), "in 'x\\x00.safetensors', which is not",
                 id="hf-index-nul"),
    pytest.param(_shard_index(_repoint("model-00003-of-00003.safetensors")),
                 "model-00003-of-00003.safetensors does not exist, but model.safetensors.index.json puts tensors in it",
                 id="hf-index-missing-file"),
    pytest.param(_shard_index(lambda weight_map, tmp_path: weight_map.clear()), "has no weight_map object",
                 id="hf-index-empty"),
    pytest.param(_shard_link_out, "model-00002-of-00002.safetensors leads outside", id="hf-index-symlink-out"),
    pytest.param(_tensor_in_both_shards, "holds 'transformer.wte.weight', which the index puts elsewhere",
                 id="hf-index-tensor-twice"),
    pytest.param(_link_out("tokenizer.json"), "tokenizer.json leads outside", id="hf-tokenizer-symlink-out"),
    pytest.param(lambda folder, tmp_path: shutil.rmtree(folder),
                 "is not a folder; give the folder that save_pretrained",
                 id="hf-folder-missing"),
]


@pytest.mark.parametrize("lie,message", LIES)
def test_each_lie_is_one_sentence_and_nothing_outside_is_opened(tmp_path, lie, message, monkeypatch):
    folder = valid_folder(tmp_path / "hf")
    (folder / "tokenizer.json").write_text('{"model": {}}')
    lie(folder, tmp_path)
    opened = opened_paths(monkeypatch, safetensors_header)
    with opened.recording(), pytest.raises(InputError) as error:
        import_hf(str(folder), str(tmp_path / "ck"))
    assert message in one_sentence(error.value)
    assert not (tmp_path / "ck").exists()
    assert not [p for p in opened.outside(folder) if p.startswith(os.path.realpath(tmp_path))]


def test_the_valid_folders_convert(tmp_path):
    """The cases above damage these: undamaged, both convert to the model they hold."""
    state = hf_state()
    for folder in (valid_folder(tmp_path / "single"), sharded(valid_folder(tmp_path / "sharded"))):
        cfg, masters = read_hf_model(str(folder))
        assert cfg == CFG
        back = masters_to_hf(masters, cfg)
        assert sorted(back) == sorted(state) and all(np.array_equal(back[k], state[k]) for k in state)


def test_bfloat16_weights_convert_exactly_widened(tmp_path):
    """save_pretrained of a bfloat16 model writes BF16 tensors: each is the top half of a float32."""
    folder = valid_folder(tmp_path / "bf16")
    state = {k: v.astype(np.float32) for k, v in load_file(str(folder / WEIGHTS)).items()}
    top_halves = {k: (v.view(np.uint32) >> 16).astype("<u2") for k, v in state.items()}
    header, data, offset = {"__metadata__": {"format": "pt"}}, b"", 0
    for name, half in top_halves.items():
        header[name] = {"dtype": "BF16", "shape": list(half.shape), "data_offsets": [offset, offset + half.nbytes]}
        data, offset = data + half.tobytes(), offset + half.nbytes
    (folder / WEIGHTS).write_bytes(joined(json.dumps(header), data))
    cfg, masters = read_hf_model(str(folder))
    back = masters_to_hf(masters, cfg)
    for name, half in top_halves.items():
        assert np.array_equal(back[name], (half.astype(np.uint32) << 16).view(np.float32)), name


# ---- --to-hf does not write over another model ---------------------------------------------------

@pytest.fixture
def checkpoint(tmp_path):
    import_hf(str(valid_folder(tmp_path / "source")), str(tmp_path / "ck"))
    return tmp_path / "ck"


def folder_bytes(folder):
    return {name: (folder / name).read_bytes() for name in sorted(os.listdir(folder))}


def test_to_hf_refuses_a_folder_that_holds_weights_unless_overwrite(tmp_path, checkpoint):
    other = valid_folder(tmp_path / "other", seed=1)        # another model, maybe its only copy
    before = folder_bytes(other)
    with pytest.raises(InputError) as error:
        export_hf(str(checkpoint), str(other))
    assert (f"--to-hf {other} already holds config.json, model.safetensors; give a new folder, or add "
            "--overwrite to replace them") == one_sentence(error.value)
    assert folder_bytes(other) == before
    export_hf(str(checkpoint), str(other), overwrite=True)
    _, masters = read_hf_model(str(other))
    _, expected = read_hf_model(str(tmp_path / "source"))
    assert all(np.array_equal(masters[k], expected[k]) for k in expected)
    assert not [name for name in os.listdir(other) if name.endswith(".partial")]


def test_to_hf_into_a_file_or_an_unrelated_folder(tmp_path, checkpoint):
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(InputError, match="is a file, not a folder"):
        export_hf(str(checkpoint), str(tmp_path / "file"))
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "README.md").write_text("mine")
    export_hf(str(checkpoint), str(tmp_path / "notes"))          # no weights there: nothing to lose
    assert sorted(os.listdir(tmp_path / "notes")) == ["README.md", "config.json", "model.safetensors"]


@pytest.mark.parametrize("existing", [True, False])
def test_a_failed_write_leaves_nothing_half_written(tmp_path, checkpoint, monkeypatch, existing):
    target = valid_folder(tmp_path / "out", seed=1) if existing else tmp_path / "out"
    before = folder_bytes(target) if existing else None

    def full_disk(tensors, path, metadata=None):
        with open(path, "wb") as f:
            f.write(b"half")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(hf_folder, "save_file", full_disk)
    with pytest.raises(InputError) as error:
        export_hf(str(checkpoint), str(target), overwrite=True)
    assert "cannot write the Hugging Face folder" in one_sentence(error.value)
    assert "No space left on device" in str(error.value)
    assert (folder_bytes(target) == before) if existing else not target.exists()


def test_the_overwrite_flag_of_the_command(tmp_path, checkpoint):
    from click.testing import CliRunner
    from npmegatron.cli import main
    other = valid_folder(tmp_path / "other", seed=1)
    run = CliRunner().invoke(main, ["convert", "--load", str(checkpoint), "--to-hf", str(other)])
    assert run.exit_code == 1 and "add --overwrite to replace them" in run.output, run.output
    run = CliRunner().invoke(main, ["convert", "--load", str(checkpoint), "--to-hf", str(other), "--overwrite"])
    assert run.exit_code == 0, run.output
    run = CliRunner().invoke(main, ["convert", "--from-hf", str(other), "--save", str(tmp_path / "ck2"), "--overwrite"])
    assert run.exit_code == 1 and "drop --overwrite" in run.output, run.output


# ---- mutations of a valid folder, generated -------------------------------------------------------

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 40)
    | st.sampled_from([0, -1, 2, 6, 8, 11, 32, 2 ** 48, 2 ** 48 + 1, 10 ** 400])
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=6)
    | st.sampled_from(["gpt2", "gelu", "gelu_new", "8", "F64", "BF16", "../x.safetensors"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=2),
    max_leaves=4)


def converts_consistently(folder):
    """Read `folder`: it converts to a model whose every master has the configuration's shape,
    finite, and whose conversion back out gives the folder's own tensors; or it is refused in one
    sentence. Any other exception fails the property."""
    try:
        cfg, masters = read_hf_model(str(folder))
    except InputError as error:
        one_sentence(error)
        return False
    assert {ours: shape for _, ours, shape in name_map(cfg)} == {k: v.shape for k, v in masters.items()}
    assert all(np.isfinite(v).all() for v in masters.values())
    stored = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            stored.update(load_file(str(folder / name)))
    back = masters_to_hf(masters, cfg)
    assert all(np.array_equal(back[k], stored[k]) for k in back)
    return True


def fuzz(tmp_path_factory, monkeypatch, template, damage, strategy, examples):
    """Each example: a copy of `template`, damaged by `damage(folder, value)`, must convert
    consistently or be refused, with nothing outside the copy opened (bait files lie beside it)."""
    base = tmp_path_factory.mktemp("fuzz")
    shutil.copy(template / (WEIGHTS if (template / WEIGHTS).exists() else SHARDS[1]), base / "x.safetensors")
    opened = opened_paths(monkeypatch, safetensors_header)
    counter = iter(range(10 ** 9))

    def check(value):
        folder = base / f"case{next(counter)}"
        shutil.copytree(template, folder, symlinks=True)
        damage(folder, value)
        with opened.recording():
            converts_consistently(folder)
        assert not [p for p in opened.outside(folder) if p.startswith(os.path.realpath(base))]
        shutil.rmtree(folder)

    check_property(strategy, check, examples)


def _damage_config(folder, case):
    kind, edits, raw = case
    if kind == "bytes":
        text = (folder / "config.json").read_bytes()
        cut, offset, noise = raw
        data = bytearray(text[:max(1, int(len(text) * cut))])
        data[offset % len(data):offset % len(data) + len(noise)] = noise
        (folder / "config.json").write_bytes(bytes(data))
        return
    config = json.loads((folder / "config.json").read_text())
    for key, how, value in edits:
        if how == "delete":
            config.pop(key, None)
        else:
            config[key] = value
    write_json(folder / "config.json", config)


@pytest.mark.parametrize("examples", BUDGETS)
def test_mutated_configs_convert_consistently_or_are_refused(tmp_path_factory, monkeypatch, examples):
    template = valid_folder(tmp_path_factory.mktemp("template") / "hf")
    keys = sorted(config_to_hf(CFG)) + ["n_ctx"]
    edits = st.lists(st.tuples(st.sampled_from(keys), st.sampled_from(["delete", "replace"]), JSON_VALUES),
                     min_size=1, max_size=3)
    damage = st.tuples(st.floats(0, 1), st.integers(0, 2 ** 16), st.binary(max_size=6))
    cases = st.tuples(st.sampled_from(["fields", "fields", "bytes"]), edits, damage)
    fuzz(tmp_path_factory, monkeypatch, template, _damage_config, cases, examples)


def _damage_weights(folder, case):
    kind, field, value, number, noise = case
    raw = (folder / WEIGHTS).read_bytes()
    header, data = split(folder / WEIGHTS)
    names = sorted(k for k in header if k != "__metadata__")
    entry = header[names[number % len(names)]]
    if kind == "length":
        raw = joined(json.dumps(header), data, length=value if type(value) is int and 0 <= value < 2 ** 64 else number)
    elif kind == "field":
        entry[field] = value
        raw = joined(json.dumps(header), data)
    elif kind == "offsets":
        entry["data_offsets"] = [entry["data_offsets"][0] + number % 17 - 8, entry["data_offsets"][1] + len(noise) - 3]
        raw = joined(json.dumps(header), data)
    elif kind == "delete":
        del header[names[number % len(names)]]
        raw = joined(json.dumps(header), data)
    elif kind == "bytes":
        where = number % len(raw)
        raw = raw[:where] + noise + raw[where + len(noise):]
    elif kind == "truncate":
        raw = raw[:number % len(raw)]
    else:
        raw = raw + noise
    (folder / WEIGHTS).write_bytes(raw)


@pytest.mark.parametrize("examples", BUDGETS)
def test_mutated_safetensors_headers_convert_consistently_or_are_refused(tmp_path_factory, monkeypatch, examples):
    template = valid_folder(tmp_path_factory.mktemp("template") / "hf")
    offsets = st.lists(st.integers(-8, 3000), max_size=3) | JSON_VALUES
    cases = st.tuples(st.sampled_from(["length", "field", "field", "offsets", "delete", "bytes", "truncate", "append"]),
                      st.sampled_from(["dtype", "shape", "data_offsets"]),
                      offsets | st.integers(0, 2 ** 64 - 1) | st.sampled_from(["F16", "F32", "BF16", "I64", "U8"]),
                      st.integers(0, 2 ** 20), st.binary(min_size=1, max_size=8))
    fuzz(tmp_path_factory, monkeypatch, template, _damage_weights, cases, examples)


def _damage_index(folder, edits):
    index = json.loads((folder / INDEX).read_text())
    names = sorted(index["weight_map"])
    for number, how, value in edits:
        key = names[number % len(names)]
        if how == "delete":
            index["weight_map"].pop(key, None)
        else:
            index["weight_map"][key] = str(folder.parent / "x.safetensors") if value == "ABSOLUTE" else value
    write_json(folder / INDEX, index)


@pytest.mark.parametrize("examples", BUDGETS)
def test_mutated_shard_indexes_convert_consistently_or_are_refused(tmp_path_factory, monkeypatch, examples):
    template = sharded(valid_folder(tmp_path_factory.mktemp("template") / "hf"))
    os.makedirs(template / "sub")
    shutil.copy(template / SHARDS[1], template / "sub" / SHARDS[1])
    os.symlink(os.path.join("..", "x.safetensors"), template / "link.safetensors")   # out, once copied
    names = st.sampled_from(["../x.safetensors", "ABSOLUTE", "sub/" + SHARDS[1], "link.safetensors", "..", ".",
                             "", "x\x00.safetensors", "./" + SHARDS[0], SHARDS[0], SHARDS[1], "absent.safetensors",
                             "sub/../" + SHARDS[1], "C:\\x.safetensors"])
    hostile = st.tuples(st.integers(0, 100), st.just("replace"), names)     # one in every example
    others = st.lists(st.tuples(st.integers(0, 100), st.sampled_from(["delete", "replace"]),
                                names | st.text(max_size=12) | JSON_VALUES), max_size=2)
    edits = st.tuples(hostile, others).map(lambda edits: [edits[0], *edits[1]])
    fuzz(tmp_path_factory, monkeypatch, template, _damage_index, edits, examples)
