"""Faults a real run meets: Ctrl-C and SIGTERM under mpiexec, a rank killed (SIGKILL, the
out-of-memory killer), a model too large for the machine, a full disk or a read-only folder while
saving, a second run writing the same folder, a `latest` that points outside it."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy
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


def wait_for_training(job, log_file, iterations=1, timeout=60):
    """Until the job has logged `iterations` iterations: every rank is then inside the training
    loop (and, with --save-interval 1 and iterations=2, has saved the first one: the log line of
    an iteration is written before its checkpoint, the next one after)."""
    deadline = time.monotonic() + timeout
    while not (os.path.exists(log_file) and len(open(log_file).read().splitlines()) >= iterations):
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


@pytest.mark.quick_variants("mpiexec0")
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


def test_sigterm_without_the_flag_ends_the_job_quickly_in_one_sentence(tmp_path):
    """What a scheduler sends before it pre-empts a job: every rank ends at once, one line says the
    job was terminated, where to resume (the checkpoint saved at iteration 1) and that
    --exit-signal-handler would have saved first; the status is 143 (128 + SIGTERM)."""
    log, ck = str(tmp_path / "log.jsonl"), tmp_path / "ck"
    job = start(2, FOREVER + ["--tp", "2", "--log-file", log, "--save", str(ck), "--save-interval", "1"])
    wait_for_training(job, log, iterations=2)
    os.kill(job.pid, signal.SIGTERM)
    code, out, err, taken = end_within(job, 10, log)
    assert code == 143 and taken < 10, (code, out, err)
    lines = [line for line in err.splitlines() if "terminated (SIGTERM)" in line]
    assert len(lines) == 1 and " stopped (" not in err, err
    assert re.fullmatch(rf"\[rank 0\] terminated \(SIGTERM\): ending every rank; resume with --load {ck} "
                        r"\(latest: iter_\d{7}\); with --exit-signal-handler a SIGTERM saves a checkpoint "
                        r"\(with --save\) and stops cleanly", lines[0]), lines[0]
    assert "Traceback" not in err and "BAD TERMINATION" not in out, (out, err)


def sentinels_of(rank_pids):
    """{pid: rank} of the sentinel (comm/sentinel.py) watching any of `rank_pids`, by sentinel pid."""
    found = {}
    for pid in processes_with("sentinel.py"):
        try:
            words = open(f"/proc/{pid}/cmdline", "rb").read().decode().split("\0")
        except OSError:
            continue
        watched = dict(reversed([int(n) for n in w.split(":")]) for w in words if re.fullmatch(r"\d+:\d+", w))
        if set(watched) & set(rank_pids):
            found[pid] = watched
    return found


@pytest.mark.quick_variants("1")
@pytest.mark.parametrize("victim", [1, 0])
def test_a_killed_rank_is_named_once_with_the_checkpoint_to_resume_from(tmp_path, victim):
    log, ck = str(tmp_path / "log.jsonl"), tmp_path / "ck"
    job = start(2, FOREVER + ["--tp", "2", "--log-file", log, "--save", str(ck), "--save-interval", "1"])
    wait_for_training(job, log, iterations=2)
    deadline = time.monotonic() + 30                    # the first checkpoint is in place
    while not (ck / "latest").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    ranks = rank_pids(log)
    (watched,) = sentinels_of(ranks).values()           # one sentinel, beside rank 0
    pid = next(pid for pid, rank in watched.items() if rank == victim)
    os.kill(pid, signal.SIGKILL)
    code, out, err, taken = end_within(job, 10, log)
    deadline = time.monotonic() + 10 - taken
    while sentinels_of(ranks) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not sentinels_of(ranks), "the sentinel outlived the job"
    assert code != 0
    lines = [line for line in err.splitlines() if " stopped (" in line]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"error: rank {victim} stopped (its process died: killed, out of memory or "
                               f"crashed), so the job is ending; resume with --load {ck} (latest: iter_"), err
    named = int(re.search(r"\(latest: iter_(\d{7})\)$", lines[0]).group(1))
    latest = int((ck / "latest").read_text()[len("iter_"):])
    assert named in (latest - 1, latest) and named >= 1      # the kill may land between the two writes
    # The residual race docs/design.md records: the other rank, reading the killed one's memory
    # (MPICH's single-copy path) as it died, may add MPICH's one fatal line (seen once in CI)
    others = [line for line in err.splitlines() if "process_vm_readv failed" not in line]
    assert len(err.splitlines()) - len(others) <= 1, err
    rest = "\n".join(others)
    assert "error stack" not in rest and "Traceback" not in rest and "Fatal error" not in rest, err


@pytest.mark.slow
def test_a_killed_rank_without_save_says_no_checkpoint_was_saved(tmp_path):
    log = str(tmp_path / "log.jsonl")
    job = start(2, FOREVER + ["--tp", "2", "--log-file", log])
    wait_for_training(job, log)
    os.kill(rank_pids(log)[0], signal.SIGKILL)
    code, out, err, taken = end_within(job, 10, log)
    assert err.count(" stopped (") == 1, err
    assert err.rstrip().endswith("so the job is ending; no checkpoint was saved (no --save)"), err


@pytest.mark.slow
@pytest.mark.parametrize("target", ["terminal", "mpiexec"])
def test_ctrl_c_of_four_ranks_is_one_line_and_status_130(tmp_path, target):
    """A terminal's Ctrl-C reaches mpiexec's process group; mpiexec forwards it to every rank."""
    log = str(tmp_path / "log.jsonl")
    job = start(4, FOREVER + ["--tp", "2", "--log-file", log])
    wait_for_training(job, log)
    if target == "terminal":
        os.killpg(job.pid, signal.SIGINT)
    else:
        os.kill(job.pid, signal.SIGINT)
    code, out, err, taken = end_within(job, 10, log)
    assert err.count("interrupted (SIGINT): ending every rank") == 1, err
    assert "BAD TERMINATION" not in out and "signal 9" not in out, out
    # The residual race docs/design.md records: a rank whose main thread was reading a peer's
    # memory (MPICH's single-copy path) as that peer exited ends with MPICH's one fatal line; the
    # job's status is then 143, or still 130 where the other ranks' 130 reached hydra first (seen
    # once in CI).
    raced = "process_vm_readv failed" in err
    assert code in ((143, 130) if raced else (130,)), (out, err)


def test_a_model_too_large_is_refused_before_it_is_built(tmp_path, monkeypatch):
    from npmegatron.perf import fit
    from npmegatron.training import trainer
    monkeypatch.setattr(fit, "available_per_rank", lambda device: (512 << 10, "the test's memory"))
    monkeypatch.setattr(trainer, "assemble", lambda *a, **k: pytest.fail("the model was built"))
    with pytest.raises(InputError) as error:
        quiet(small(tmp_path))
    assert re.fullmatch(r"this run needs about [\d.]+ KiB of memory per rank \([\d.]+ KiB for the weights, "
                        r"gradients and AdamW state, [\d.]+ KiB for activations\), but 512.0 KiB is available "
                        r"to each \(the test's memory\); use fewer --num-layers or a smaller --hidden-size, "
                        r"more ranks for --tp or --pp, --recompute-granularity full or a smaller "
                        r"--micro-batch-size \(NPMEGATRON_MEMORY_CHECK=0 skips this check\)", str(error.value))
    monkeypatch.setenv("NPMEGATRON_MEMORY_CHECK", "0")
    with pytest.raises(pytest.fail.Exception, match="the model was built"):
        quiet(small(tmp_path))


def test_on_the_gpu_the_free_memory_of_the_card_is_shared_by_the_ranks_bound_to_it(monkeypatch):
    from fakes.strict_cupy import strict_cupy
    from npmegatron.perf import fit
    monkeypatch.setenv("STRICT_CUPY_DEVICE_BYTES", str(3 << 30))
    monkeypatch.setattr(fit.comm, "launched_by_mpi", lambda: True)
    monkeypatch.setattr(fit.comm, "local_size", lambda: 4)
    with strict_cupy(devices=2):
        available, where = fit.available_per_rank("gpu")
    assert available == (3 << 30) // 2
    assert where == "3.0 GiB of the free memory of GPU 0 shared by 2 ranks"


def test_an_allocation_that_fails_later_is_one_sentence(monkeypatch):
    from click.testing import CliRunner
    from npmegatron.cli import main
    from npmegatron.training import trainer
    monkeypatch.setattr(trainer, "assemble", lambda *a, **k: numpy.empty(1 << 62, numpy.uint8))
    result = CliRunner().invoke(main, ["train"] + TINY + ["--train-iters", "1"])
    assert result.exit_code == 1 and not isinstance(result.exception, MemoryError), result.output
    assert result.output.splitlines() == [
        "Error: out of memory: Unable to allocate 4.00 EiB for an array with shape (4611686018427387904,) "
        "and data type uint8; use fewer --num-layers or a smaller --hidden-size, more ranks for --tp or --pp, "
        "--recompute-granularity full or a smaller --micro-batch-size"], result.output


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


@pytest.mark.quick_variants("iter_1")
@pytest.mark.parametrize("pointer", ["../other/iter_0000001", "/abs/iter_0000001", "iter_1", "iter_0000001/.."])
def test_latest_must_name_an_iteration_folder_inside(tmp_path, pointer):
    quiet(small(tmp_path, save=str(tmp_path / "other"), train_iters=1))
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "latest").write_text(pointer)
    with pytest.raises(InputError) as error:
        quiet(small(tmp_path, load=str(tmp_path / "ck")))
    assert str(error.value) == (f"{tmp_path / 'ck' / 'latest'} names {pointer!r}, not a checkpoint of this "
                                "folder (iter_NNNNNNN); repair it, or pass an iteration folder to --load")


@pytest.mark.parametrize("latest, expected", [
    ("iter_0000007\n", "resume with --load {folder} (latest: iter_0000007)"),
    (None, "the last hint"),                                    # nothing saved yet
    ("../../etc/passwd", "the last hint"),                      # not the saver's pointer: not quoted
    ("iter_12x", "the last hint"),
])
def test_the_sentinel_names_the_latest_checkpoint_on_disk(tmp_path, latest, expected):
    from npmegatron.comm import sentinel
    if latest is not None:
        (tmp_path / "latest").write_text(latest)
    watch = sentinel.Watch.__new__(sentinel.Watch)      # its state only, no sockets
    watch.folder, watch.since, watch.hint = str(tmp_path), time.time() - 60, "the last hint"
    assert watch.resume_hint() == expected.format(folder=tmp_path)
    watch.since = time.time() + 60                      # latest is older than the run: not its own
    assert watch.resume_hint() == "the last hint"
    watch.folder = None                                 # no --save: the hint alone
    assert watch.resume_hint() == "the last hint"
