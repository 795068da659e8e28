"""`npmegatron bench comm`: bandwidth of all-reduce, all-gather, reduce-scatter and send/recv over
message sizes, with a latency-bandwidth (alpha-beta) fit t(S) = alpha + S / bandwidth per op.

Size S is the full buffer: all-reduce of S bytes, all-gather producing S, reduce-scatter of S,
send/recv of S (one way, half a ping-pong). Bus bandwidth uses NCCL-tests' factors.
"""
import json
import time

import numpy

from npmegatron import comm


def _sizes(min_bytes, max_bytes):
    sizes, s = [], min_bytes
    while s <= max_bytes:
        sizes.append(s)
        s *= 4
    return sizes


def _iterations(nbytes):
    return int(min(50, max(3, 2 ** 26 // max(nbytes, 1))))


def _device_sync(xp):
    """A call that returns once the device finished its queued work: GPU calls return when their
    work is queued, so without it the clock would time the queueing, not the transfer."""
    if xp is numpy:
        return lambda: None
    return lambda: xp.cuda.Device().synchronize()


def _timed(world, fn, iters, sync=lambda: None):
    """Seconds per call, the slowest rank's (a collective is as slow as its last member)."""
    fn()
    sync()
    comm.barrier(world)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    elapsed = numpy.array([(time.perf_counter() - start) / iters])
    return float(comm.all_reduce(elapsed, world, "max")[0])


def _ping_pong(world, x, xp=numpy):
    """Even rank r and odd rank r+1 exchange x there and back; one-way time is half. Receives
    name the array module: a NumPy receive posts an MPI receive, which never meets an NCCL send."""
    r, n = world.rank, world.size
    peer = r ^ 1
    if peer >= n:
        return lambda: None
    if r % 2 == 0:
        return lambda: (comm.send(x, peer, world), comm.recv(peer, x.shape, x.dtype, world, xp=xp))
    return lambda: (comm.recv(peer, x.shape, x.dtype, world, xp=xp), comm.send(x, peer, world))


def alpha_beta_fit(sizes, times):
    """Least squares of alpha + beta * S against t, in relative error so small messages count."""
    s, t = numpy.asarray(sizes, float), numpy.asarray(times, float)
    a = numpy.stack([numpy.ones_like(s), s], axis=1) / t[:, None]
    (alpha, beta), *_ = numpy.linalg.lstsq(a, numpy.ones_like(t), rcond=None)
    return float(alpha), float(beta)


BUS_FACTOR = {"all_reduce": lambda p: 2 * (p - 1) / p, "all_gather": lambda p: (p - 1) / p,
              "reduce_scatter": lambda p: (p - 1) / p, "sendrecv": lambda p: 1.0}


def bench_comm(min_bytes=1024, max_bytes=64 * 2 ** 20, device="cpu"):
    world = comm.init()
    p = world.size
    xp = numpy
    if device == "gpu":
        import cupy as xp
    rows, fits = [], {}
    for op in ("all_reduce", "all_gather", "reduce_scatter", "sendrecv"):
        times = []
        for nbytes in _sizes(min_bytes, max_bytes):
            count = max(p, nbytes // 4 // p * p)        # float32, divisible by the group size
            full = xp.ones(count, numpy.float32)
            shard = full[: count // p].copy()
            fn = {"all_reduce": lambda: comm.all_reduce(full, world),
                  "all_gather": lambda: comm.all_gather(shard, world),
                  "reduce_scatter": lambda: comm.reduce_scatter(full, world),
                  "sendrecv": _ping_pong(world, full, xp)}[op]
            seconds = _timed(world, fn, _iterations(full.nbytes), _device_sync(xp))
            if op == "sendrecv":
                seconds /= 2
            times.append(seconds)
            rows.append((op, full.nbytes, seconds, full.nbytes / seconds,
                         full.nbytes / seconds * BUS_FACTOR[op](p)))
        alpha, beta = alpha_beta_fit([r[1] for r in rows if r[0] == op], times)
        fits[op] = {"alpha_us": alpha * 1e6, "bandwidth_GBps": 1 / beta / 1e9 if beta > 0 else None}
    return {"ranks": p, "device": device, "fits": fits,
            "table": [{"op": r[0], "bytes": r[1], "seconds": r[2], "algbw_GBps": r[3] / 1e9,
                       "busbw_GBps": r[4] / 1e9} for r in rows]}


def format_report(result):
    lines = [f"{'op':<15}{'bytes':>12}{'time (us)':>13}{'algbw GB/s':>12}{'busbw GB/s':>12}"]
    for r in result["table"]:
        lines.append(f"{r['op']:<15}{r['bytes']:>12}{r['seconds'] * 1e6:>13.1f}"
                     f"{r['algbw_GBps']:>12.3f}{r['busbw_GBps']:>12.3f}")
    lines.append(f"alpha-beta fit on {result['ranks']} ranks ({result['device']}): t = alpha + bytes / bandwidth")
    for op, fit in result["fits"].items():
        bw = "n/a" if fit["bandwidth_GBps"] is None else f"{fit['bandwidth_GBps']:.2f} GB/s"
        lines.append(f"  {op:<15} alpha {fit['alpha_us']:8.1f} us   bandwidth {bw}")
    lines.append(json.dumps(result))
    return "\n".join(lines)
