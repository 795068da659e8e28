"""Faults a real run meets: Ctrl-C and SIGTERM under mpiexec, a full disk or a read-only folder
while saving, a second run writing the same folder, a `latest` that points outside it."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import ROOT, mpiexec_path, rank_environment
from npmegatron.checkpointing import checkpoint
from npmegatron.autograd import InputError
from npmegatron.training import TrainConfig, train

TINY = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
        "--micro-batch-size", "2", "--lr-warmup-iters", "1", "--eval-iters", "1", "--sample-tokens", "0",
        "--dtype", "float64"]
FOREVER = TINY + ["--train-iters", "1000000", "--log-interval", "1", "--eval-interval", "1000000"]


def start(ranks, args):
    """A training job in its own session (so nothing outlives the test), output to pipes."""
    command = ([mpiexec_path(), "-n", str(ranks)] if ranks else []) + [sys.executable, "scripts/train.py"]
    return subprocess.Popen(command + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, env=rank_environment(), start_new_session=True)


def wait_for_training(job, log_file, timeout=60):
    """Until the job has logged an iteration: every rank is then inside the training loop."""
    deadline = time.monotonic() + timeout
    while not (os.path.exists(log_file) and open(log_file).read().strip()):
        if job.poll() is not None or time.monotonic() > deadline:
            job.kill()
            pytest.fail(f"the job never started training: {job.communicate()}")
        time.sleep(0.1)


def processes_with(marker):
    """Live processes whose command line holds `marker` (a path unique to the test)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


def end_within(job, seconds, marker):
    """(exit code, stdout, stderr, seconds taken); fails if the job or any rank outlives `seconds`."""
    begin = time.monotonic()
    try:
        out, err = job.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        pytest.fail(f"still running {seconds} s after the signal: {job.communicate()}")
    taken = time.monotonic() - begin
    deadline = time.monotonic() + 2
    while processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not processes_with(marker), f"ranks left behind: {processes_with(marker)}"
    return job.returncode, out, err, taken


def rank_pids(marker):
    return sorted(p for p in processes_with(marker) if b"scripts/train.py" in
                  open(f"/proc/{p}/cmdline", "rb").read() and b"mpiexec" not in
                  open(f"/proc/{p}/cmdline", "rb").read().split(b"\0")[0])


@pytest.mark.parametrize("target", ["mpiexec", "mpiexec", "mpiexec", "rank 1"])
def test_ctrl_c_ends_every_rank_within_10_s(tmp_path, target):
    log = str(tmp_path / "log.jsonl")
    job = start(2, FOREVER + ["--tp", "2", "--log-file", log])
    wait_for_training(job, log)
    victim = job.pid if target == "mpiexec" else rank_pids(log)[-1]
    os.kill(victim, signal.SIGINT)
    code, out, err, taken = end_within(job, 10, log)
    assert code != 0 and taken < 10, (out, err)
    assert err.count("interrupted (SIGINT): ending every rank") == 1, err
    assert "Traceback" not in err


def test_sigterm_with_exit_signal_handler_saves_and_exits_0(tmp_path):
    log, ck = str(tmp_path / "log.jsonl"), tmp_path / "ck"
    job = start(2, FOREVER + ["--tp", "2", "--log-file", log, "--exit-signal-handler", "--save", str(ck)])
    wait_for_training(job, log)
    os.kill(job.pid, signal.SIGTERM)          # mpiexec forwards it to every rank, as Slurm sends it
    code, out, err, _ = end_within(job, 30, log)
    assert code == 0, (out, err)
    lines = [line for line in out.splitlines() if "SIGTERM received" in line]
    assert len(lines) == 1, out
    iteration = int(lines[0].split("after iteration ")[1].split(";")[0])
    assert lines[0].endswith(f"checkpoint saved in {ck / f'iter_{iteration:07d}'}")
    assert (ck / "latest").read_text() == f"iter_{iteration:07d}"
    assert json.loads((ck / f"iter_{iteration:07d}" / "manifest.json").read_text())["iteration"] == iteration


def test_sigterm_without_the_flag_ends_the_job_quickly(tmp_path):
    log = str(tmp_path / "log.jsonl")
    job = start(2, FOREVER + ["--tp", "2", "--log-file", log])
    wait_for_training(job, log)
    os.kill(job.pid, signal.SIGTERM)
    code, out, err, taken = end_within(job, 10, log)
    assert code != 0 and taken < 10


def small(tmp_path, **kw):
    base = dict(num_layers=1, hidden_size=32, num_attention_heads=2, seq_length=32, micro_batch_size=2,
                train_iters=2, lr_warmup_iters=1, eval_iters=1, sample_tokens=0, dtype="float64")
    return TrainConfig.from_flat(**{**base, **kw})


def quiet(args):
    return train(args, echo=lambda *a: None)


def test_disk_full_while_writing_is_one_sentence_and_keeps_latest(tmp_path, monkeypatch):
    ck = tmp_path / "ck"
    quiet(small(tmp_path, save=str(ck), save_interval=1, train_iters=1))
    real = checkpoint._write_synced

    def full(path, data):
        if ".partial" in path and path.endswith(".safetensors"):
            real(path, data[: len(data) // 2])         # half written, then the disk is full
            raise OSError(28, "No space left on device", path)
        real(path, data)

    monkeypatch.setattr(checkpoint, "_write_synced", full)
    with pytest.raises(InputError) as error:
        quiet(small(tmp_path, save=str(ck), load=str(ck), save_interval=1, train_iters=2))
    assert str(error.value).startswith(f"checkpoint folder {ck} ran out of disk space saving iteration 2, "
                                       "which needs ")
    assert (ck / "latest").read_text() == "iter_0000001"
    assert sorted(os.listdir(ck)) == [".npmegatron.lock", "iter_0000001", "latest"]


@pytest.fixture
def tmpfs(tmp_path):
    """mount(size, read_only=False) -> a fresh tmpfs folder; needs root (skips otherwise)."""
    mounted = []

    def mount(size, read_only=False):
        folder = tmp_path / f"tmpfs{len(mounted)}"
        folder.mkdir()
        options = f"size={size}" + (",ro" if read_only else "")
        if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)],
                                                capture_output=True).returncode != 0:
            pytest.skip("mounting a tmpfs needs root")
        mounted.append(folder)
        return folder

    yield mount
    for folder in mounted:
        subprocess.run(["umount", str(folder)], capture_output=True)


def run_train(args, timeout=120):
    return subprocess.run([sys.executable, "scripts/train.py"] + args, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=rank_environment())


def test_a_real_full_disk_is_one_sentence_and_keeps_latest(tmpfs):
    disk = tmpfs("800k")           # one checkpoint of this model (532 kB) fits, two do not
    ck = disk / "ck"
    result = run_train(TINY + ["--train-iters", "3", "--save", str(ck), "--save-interval", "1"])
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: checkpoint folder {ck} has no room for "
                                                   "iteration 2: it needs "), result.stderr
    assert "bytes and" in lines[0] and "are free; free some disk space" in lines[0]
    assert (ck / "latest").read_text() == "iter_0000001"
    assert not any(name.endswith(".partial") for name in os.listdir(ck))


@pytest.mark.parametrize("where", ["read-only mount", "below a file"])
def test_an_unwritable_save_folder_is_refused_before_training(tmp_path, tmpfs, where):
    if where == "read-only mount":
        save = tmpfs("64k", read_only=True)
    else:
        (tmp_path / "file").write_text("x")
        save = tmp_path / "file" / "ck"
    result = run_train(TINY + ["--train-iters", "2", "--save", str(save)])
    assert result.returncode == 1
    assert result.stderr.startswith(f"Error: --save {save} is not a writable folder ("), result.stderr
    assert "iter " not in result.stdout            # refused before the first iteration


def manifests(folder):
    return {name: (folder / name / "manifest.json").read_bytes() for name in os.listdir(folder)
            if name.startswith("iter_")}


def test_another_runs_checkpoints_are_never_replaced_silently(tmp_path):
    ck = tmp_path / "ck"
    quiet(small(tmp_path, save=str(ck), save_interval=1, train_iters=2))
    before = manifests(ck)
    with pytest.raises(InputError, match=f"--save {ck} holds checkpoints of another run "
                                         r"\(iter_0000001, run id [0-9a-f]{32}\); resume it with --load"):
        quiet(small(tmp_path, save=str(ck), seed=7))
    assert manifests(ck) == before and (ck / "latest").read_text() == "iter_0000002"
    quiet(small(tmp_path, save=str(ck), load=str(ck), train_iters=3))       # resuming is allowed
    assert (ck / "latest").read_text() == "iter_0000003"
    quiet(small(tmp_path, save=str(ck), seed=7, train_iters=1, overwrite=True))
    assert sorted(manifests(ck)) == ["iter_0000001"] and (ck / "latest").read_text() == "iter_0000001"
    assert json.loads(manifests(ck)["iter_0000001"])["args"]["model"]["seed"] == 7


def test_a_second_run_on_the_same_folder_is_refused_naming_the_first(tmp_path):
    log, ck = str(tmp_path / "log.jsonl"), tmp_path / "ck"
    first = start(0, FOREVER + ["--log-file", log, "--save", str(ck)])
    try:
        wait_for_training(first, log)
        second = run_train(TINY + ["--train-iters", "1", "--save", str(ck), "--overwrite"])
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.communicate()
    assert second.returncode == 1
    assert second.stderr.startswith(f"Error: --save {ck} is in use by another run (host "
                                    f"{os.uname().nodename}, process {first.pid}); wait"), second.stderr


@pytest.mark.parametrize("pointer", ["../other/iter_0000001", "/abs/iter_0000001", "iter_1", "iter_0000001/.."])
def test_latest_must_name_an_iteration_folder_inside(tmp_path, pointer):
    quiet(small(tmp_path, save=str(tmp_path / "other"), train_iters=1))
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "latest").write_text(pointer)
    with pytest.raises(InputError) as error:
        quiet(small(tmp_path, load=str(tmp_path / "ck")))
    assert str(error.value) == (f"{tmp_path / 'ck' / 'latest'} names {pointer!r}, not a checkpoint of this "
                                "folder (iter_NNNNNNN); repair it, or pass an iteration folder to --load")
