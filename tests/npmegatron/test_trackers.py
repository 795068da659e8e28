"""--tensorboard-dir and --wandb-project: each interval's figures under Megatron-LM's scalar names,
read back with the tools' own readers (TensorBoard's event accumulator; W&B's record protobufs
in its offline run file) and equal to the --log-file records of the same run."""
import glob
import json
import math
import re
import struct
import time

import pytest

from npmegatron.autograd import InputError
from npmegatron.training import TrainConfig, train, trackers

SMALL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=32, micro_batch_size=4, lr=3e-3,
             lr_warmup_iters=1, train_iters=8, log_interval=4, eval_interval=4, eval_iters=1, sample_tokens=0)


def run(tmp_path, **options):
    train(TrainConfig.from_flat(**SMALL, log_file=str(tmp_path / "log.jsonl"), **options), echo=lambda line: None)
    return [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]


def tag(name):
    """A scalar's tag as tensorboardX stores it: characters TensorBoard's tags do not take become _."""
    return re.sub(r"[^-/\w.]", "_", name)


def test_tensorboard_reads_back_every_interval_under_megatrons_names(tmp_path):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    logged = run(tmp_path, tensorboard_dir=str(tmp_path / "tb"))
    reader = event_accumulator.EventAccumulator(str(tmp_path / "tb"))
    reader.Reload()
    tags = set(reader.Tags()["scalars"])
    assert {tag(name) for name in ("lm loss", "lm loss validation", "lm loss validation ppl", "learning-rate",
                                   "grad-norm", "throughput", "tokens-per-second", "model-flops-utilisation",
                                   "iteration-time")} <= tags
    for key, name in (("loss", "lm loss"), ("lr", "learning-rate"), ("grad_norm", "grad-norm"),
                      ("val_loss", "lm loss validation"), ("tflops_per_rank", "throughput")):
        events = reader.Scalars(tag(name))
        assert [e.step for e in events] == [r["iteration"] for r in logged] == [4, 8]
        assert [e.value for e in events] == pytest.approx([r[key] for r in logged], rel=1e-6)   # float32 in the file
    ppl = [e.value for e in reader.Scalars(tag("lm loss validation ppl"))]
    assert ppl == pytest.approx([math.exp(r["val_loss"]) for r in logged], rel=1e-6)


def wandb_records(path):
    """The Record protobufs of a W&B run file: its 7-byte header (":W&B", magic, version), then
    LevelDB's log format, 32 KiB blocks of chunks (CRC32C, length, type: 1 full, 2 first,
    3 middle, 4 last), as wandb's own datastore writes them."""
    wandb_internal_pb2 = pytest.importorskip("wandb.proto.wandb_internal_pb2")
    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    records, position, pending = [], 7, b""
    while position + 7 <= len(data):
        if 32768 - position % 32768 < 7:                   # a block's tail too short for a header is padding
            position += 32768 - position % 32768
            continue
        length, kind = struct.unpack("<HB", data[position + 4:position + 7])
        chunk, position = data[position + 7:position + 7 + length], position + 7 + length
        if kind == 0 and length == 0:
            break
        pending += chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


@pytest.mark.slow
def test_wandb_offline_run_holds_every_interval(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logged = run(tmp_path, wandb_project="npmegatron-test", wandb_exp_name="small", wandb_save_dir=str(tmp_path / "wb"))
    [path] = glob.glob(str(tmp_path / "wb" / "wandb" / "offline-run-*" / "run-*.wandb"))
    # wandb's service process writes the file; once in CI it was read there still without its
    # run record right after finish() returned, so the reader waits (10 s at most) for it
    deadline = time.monotonic() + 10
    while True:
        records = wandb_records(path)
        runs = [r.run for r in records if r.WhichOneof("record_type") == "run"]
        if runs or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert runs[0].project == "npmegatron-test" and runs[0].display_name == "small"
    history = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    assert [h["_step"] for h in history] == [r["iteration"] for r in logged]
    for row, record in zip(history, logged):
        assert row["lm loss"] == pytest.approx(record["loss"]) and row["learning-rate"] == record["lr"]
        assert row["grad-norm"] == pytest.approx(record["grad_norm"])
        assert row["lm loss validation"] == pytest.approx(record["val_loss"])
    config = {item.key: json.loads(item.value_json) for item in runs[0].config.update}     # as --config takes it
    assert config["num-layers"] == 2 and config["train-iters"] == 8 and config["wandb-project"] == "npmegatron-test"


def test_a_missing_tracker_package_is_one_sentence(monkeypatch):
    def missing(name):
        raise ImportError(name)
    monkeypatch.setattr(trackers.importlib, "import_module", missing)
    with pytest.raises(InputError, match=r"--wandb-project needs the wandb package, which is not installed: "
                                         r"pip install 'npmegatron\[wandb\]'"):
        trackers.Trackers(TrainConfig.from_flat(**SMALL, wandb_project="p"), echo=print)
