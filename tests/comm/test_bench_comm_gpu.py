"""`bench comm --device gpu` without a GPU: a fake cupy and a fake comm record what the benchmark
asks for. Receives must name the array module (a NumPy receive is an MPI receive, which never
meets an NCCL send: a hang), and the device must finish its work before the clock is read (GPU
calls return once queued)."""
import importlib
import itertools
import sys
import types

import numpy
from fakes.fake_cupy import FakeCupy

bench = importlib.import_module("npmegatron.bench.comm")


def fake_comm(log, world):
    def op(name, result=lambda *a, **k: None):
        def call(*args, **kwargs):
            log.append(name)
            return result(*args, **kwargs)
        return call
    recv_modules = []

    def recv(src, shape, dtype, group=None, tag=0, xp=numpy):      # comm.recv's default
        recv_modules.append(xp)
        log.append("recv")
        return None
    same = lambda x, *a, **k: x                                      # noqa: E731
    return types.SimpleNamespace(
        init=lambda: world, barrier=op("barrier"), send=op("send"), recv=recv,
        all_reduce=op("all_reduce", same), all_gather=op("all_gather", same),
        reduce_scatter=op("reduce_scatter", same), recv_modules=recv_modules)


def run_gpu_bench(monkeypatch, rank):
    log = []
    cupy = FakeCupy(devices=1, log=log)
    comm = fake_comm(log, types.SimpleNamespace(rank=rank, size=2))
    ticks = itertools.count(1)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(bench, "comm", comm)
    monkeypatch.setattr(bench, "time", types.SimpleNamespace(
        perf_counter=lambda: log.append("clock") or float(next(ticks))))
    bench.bench_comm(min_bytes=1024, max_bytes=4096, device="gpu")
    return log, comm, cupy


def test_gpu_receives_name_the_array_module(monkeypatch):
    for rank in (0, 1):
        _, comm, cupy = run_gpu_bench(monkeypatch, rank)
        assert comm.recv_modules and all(xp is cupy for xp in comm.recv_modules)


def test_clock_is_read_only_after_the_device_finished(monkeypatch):
    log, _, _ = run_gpu_bench(monkeypatch, 0)
    device_work = {"send", "recv", "all_reduce", "all_gather", "reduce_scatter"}
    pending = False
    for entry in log:
        if entry in device_work:
            pending = True
        elif entry == "sync":
            pending = False
        elif entry == "clock":
            assert not pending, "clock read with GPU work still queued"
    assert log.count("sync") > 0


def test_cpu_bench_does_not_touch_cupy(monkeypatch):
    log = []
    comm = fake_comm(log, types.SimpleNamespace(rank=0, size=2))
    monkeypatch.setitem(sys.modules, "cupy", None)          # importing it would fail
    monkeypatch.setattr(bench, "comm", comm)
    bench.bench_comm(min_bytes=1024, max_bytes=1024, device="cpu")
    assert "sync" not in log and all(xp is numpy for xp in comm.recv_modules)
