"""preprocess's documents as token ids: each text file whole, each JSONL line one document per
--json-keys key, tokenized a chunk at a time on --workers processes and taken back in input order,
as Megatron's tools/preprocess_data.py spreads documents over its --workers. Every chunk goes
through the same `encode_chunk`, so the tokens do not depend on how many workers there are."""
import collections
import contextlib
import ctypes
import json
import math
import multiprocessing
import os
import signal
import sys
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import numpy

from ..autograd import InputError
from .tokenizer import ByteTokenizer, HFTokenizer, utf8_bytes

# Text per task: about a tenth of a second of byte-level BPE, so the last tasks leave no core idle
# for long, yet hundreds of times what sending it to a worker and its tokens back costs.
CHUNK_BYTES = 1 << 17
# Text sent to the workers and not yet taken back, at most (or one larger file, a document whole):
# the results in flight hold up to 8 bytes of token ids per byte of text.
BYTES_IN_FLIGHT = 32 << 20
# Linux forks the workers: they start in milliseconds with the modules and tokenizer loaded, and
# nothing of __main__ runs again, so a script read from stdin works (spawn re-runs __main__ from its
# file, and stdin has none). Preprocessing starts no MPI and no threads of its own (OpenBLAS's idle
# ones are fork-safe), so a fork copies no held lock. Elsewhere (macOS's system libraries do not
# survive a fork) they are spawned.
START_METHOD = "fork" if sys.platform.startswith("linux") else "spawn"
PR_SET_PDEATHSIG = 1        # <linux/prctl.h>: the signal a process gets when its parent dies
CGROUP_ROOT = "/sys/fs/cgroup"      # a container's own cgroup, where it has a namespace of its own


def default_workers(cgroup_root=CGROUP_ROOT):
    """The cores this process may run on: the machine's, or those mpiexec, taskset or a cpuset binds
    it to (one rank bound to one core tokenizes on that core alone); and no more than a container's
    CPU quota (`cpu_quota`), which a container's scheduler enforces while every core stays visible,
    so that more workers would only take turns."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = cpu_quota(cgroup_root)
    return cores if quota is None else min(cores, quota)


def cpu_quota(cgroup_root=CGROUP_ROOT):
    """The CPUs a cgroup's quota allows, rounded up: cgroup v2's cpu.max ("QUOTA PERIOD", "max
    PERIOD" for none), else v1's cpu.cfs_quota_us over cpu.cfs_period_us (-1 for none); None for no
    quota, and where the files are missing or cannot be read."""
    v2 = _read_cgroup_file(os.path.join(cgroup_root, "cpu.max"))
    if v2 is not None:
        return _cpus(*v2.split()) if len(v2.split()) == 2 else None
    for controller in ("cpu", "cpu,cpuacct"):
        folder = os.path.join(cgroup_root, controller)
        quota = _read_cgroup_file(os.path.join(folder, "cpu.cfs_quota_us"))
        if quota is not None:
            return _cpus(quota, _read_cgroup_file(os.path.join(folder, "cpu.cfs_period_us")))
    return None


def _cpus(quota, period):
    """ceil(quota / period) CPUs, or None: "max", -1, a missing period or anything not a count."""
    try:
        quota, period = int(quota), int(period)
    except (TypeError, ValueError):
        return None
    return -(-quota // period) if quota > 0 and period > 0 else None


def _read_cgroup_file(path):
    try:
        with open(path, encoding="ascii") as f:
            return f.read().strip()
    except (OSError, UnicodeDecodeError):
        return None


def check_workers(workers):
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise InputError(f"workers is {workers}; it must be a positive integer (the processes that "
                         f"tokenize; the default, {default_workers()} here, uses every core this process may "
                         "use)")


def processes_for(files, tokenizer_file, workers):
    """How many processes tokenize: --workers, but no more than there are chunks of text, and one for
    byte-level tokens, whose encoding is the bytes as they are (a worker would only copy them)."""
    check_workers(workers)
    if tokenizer_file is None:
        return 1
    return max(1, min(workers, math.ceil(sum(os.path.getsize(path) for path in files) / CHUNK_BYTES)))


def encode_document(tokenizer, text, eod=None):
    """A document's token ids, with `eod` after a non-empty one as Megatron's preprocess_data.py
    does. Under the byte tokenizer, a file's bytes are its ids as they are (nothing decoded)."""
    if isinstance(tokenizer, ByteTokenizer):
        ids = numpy.frombuffer(text if isinstance(text, bytes) else utf8_bytes(text), numpy.uint8)
    else:
        text = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text
        ids = numpy.asarray(tokenizer.encode(text), numpy.int64)
    return numpy.append(ids, eod) if ids.size and eod is not None else ids


def _pieces(files, keys):
    """(path, line number, text) of every text file (number None: the file is one document, as
    bytes) and every non-blank JSONL line, read here; the workers parse and tokenize them."""
    for path in files:
        if keys == [None]:
            with open(path, "rb") as f:
                yield path, None, f.read()
        else:
            with open(path, encoding="utf-8", errors="replace") as f:
                yield from ((path, number, line) for number, line in enumerate(f, 1) if line.strip())


def _chunks(pieces):
    """Pieces in runs of about CHUNK_BYTES, in order."""
    chunk, size = [], 0
    for piece in pieces:
        chunk.append(piece)
        size += len(piece[2])
        if size >= CHUNK_BYTES:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def _record(path, number, line, keys):
    """A JSONL line's object, which holds a string under every key."""
    try:
        record = json.loads(line)
    except (ValueError, RecursionError) as error:      # RecursionError: nested too deeply to parse
        raise InputError(f"{path} line {number} is not JSON ({error}); give one JSON object "
                         "per line") from None
    if not isinstance(record, dict):
        raise InputError(f"{path} line {number} is a JSON {type(record).__name__}, not an "
                         "object; give one JSON object per line")
    for key in keys:
        if not isinstance(record.get(key), str):
            found = "no" if key not in record else f"a {type(record[key]).__name__} under the"
            raise InputError(f"{path} line {number} has {found} {key!r} key, not text; pass "
                             "--json-keys naming its text fields")
    return record


def encode_chunk(chunk, tokenizer, keys, eod):
    """(source, key, ids) of every non-empty document of a chunk of pieces; text that cannot be
    read or encoded names its place."""
    encoded = []
    for path, number, raw in chunk:
        if number is None:
            documents = [(path, None, raw)]
        else:
            record = _record(path, number, raw, keys)
            documents = [(f"{path} line {number}", key, record[key]) for key in keys]
        for source, key, text in documents:
            try:
                ids = encode_document(tokenizer, text, eod)
            except InputError as error:
                raise InputError(f"{source}: {error}") from None
            if ids.size:
                encoded.append((source, key, ids))
    return encoded


@contextlib.contextmanager
def tokenized(files, keys, tokenizer, tokenizer_file, eod, workers):
    """An iterator of (source, key, ids) of every non-empty document, in input order, tokenized on
    processes_for(...) processes; leaving the block stops them."""
    chunks = _chunks(_pieces(files, keys))
    processes = processes_for(files, tokenizer_file, workers)
    if processes == 1:
        yield (document for chunk in chunks for document in encode_chunk(chunk, tokenizer, keys, eod))
        return
    pool = ProcessPoolExecutor(processes, multiprocessing.get_context(START_METHOD), initializer=_start_worker,
                               initargs=(tokenizer_file, keys, eod, os.getpid()))
    try:
        yield (document for encoded in _in_order(pool, chunks, processes) for document in encoded)
    finally:
        pool.shutdown(cancel_futures=True)


def _in_order(pool, chunks, processes):
    """The workers' encode_chunk of each chunk, in input order; in flight at most two chunks a
    worker and BYTES_IN_FLIGHT of text (or one chunk, however large), so memory stays bounded."""
    pending, in_flight = collections.deque(), 0
    try:
        while True:
            try:
                chunk = next(chunks, None)
            except OSError:              # reading a later file failed: an earlier document's error first
                for future, _ in pending:
                    future.result()
                raise
            if chunk is None:
                break
            size = sum(len(piece[2]) for piece in chunk)
            while pending and (len(pending) >= 2 * processes or in_flight + size > BYTES_IN_FLIGHT):
                future, done = pending.popleft()
                in_flight -= done
                yield future.result()
            pending.append((pool.submit(_encode_in_worker, chunk), size))
            in_flight += size
        while pending:
            yield pending.popleft()[0].result()
    except BrokenProcessPool:
        raise InputError("a --workers process ended abruptly (killed, or out of memory); run again with "
                         "fewer --workers") from None


_worker = {}


def _start_worker(tokenizer_file, keys, eod, parent):
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # Ctrl-C: the parent stops the pool, one message
    if sys.platform.startswith("linux"):             # a parent killed outright takes its workers with it
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:                   # it died before prctl took effect
            os._exit(1)
    _worker.update(tokenizer=HFTokenizer(tokenizer_file), keys=keys, eod=eod)


def _encode_in_worker(chunk):
    return encode_chunk(chunk, **_worker)
