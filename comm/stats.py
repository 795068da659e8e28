"""Accounting: every collective and point-to-point call records op, group, bytes and seconds.

Bytes are what this rank hands to the call (its input buffer), so counts and volumes can be held
against the paper's (2 all-reduces forward and 2 backward per transformer layer). Seconds are the
host's clock for MPI; for NCCL the call's own time on its stream, from events (streams.EventClock),
read when the statistics are, so that measuring never makes the host wait mid-step.
"""
import weakref
from collections import defaultdict


class Stats:
    """A snapshot: {op: {group: {"count", "bytes", "seconds"}}} with small query helpers."""

    def __init__(self, table):
        self.table = {op: {g: dict(v) for g, v in groups.items()} for op, groups in table.items()}

    def _total(self, key, op, group):
        groups = self.table.get(op, {})
        return sum(v[key] for g, v in groups.items() if group is None or g == group)

    def count(self, op, group=None):
        return self._total("count", op, group)

    def bytes(self, op, group=None):
        return self._total("bytes", op, group)

    def seconds(self, op, group=None):
        return self._total("seconds", op, group)

    def __repr__(self):
        rows = [f"{op}[{g}]: {v['count']} calls, {v['bytes']} B, {v['seconds']:.4f} s"
                for op, groups in sorted(self.table.items()) for g, v in sorted(groups.items())]
        return "Stats(" + "; ".join(rows) + ")"


_table = defaultdict(lambda: defaultdict(lambda: {"count": 0, "bytes": 0, "seconds": 0.0}))
_unread = defaultdict(list)         # (op, group) -> clocks whose seconds are not yet in _table
_watches = weakref.WeakSet()
_UNREAD_LIMIT = 256                 # past it, the clocks already finished are read (a query, no wait)


def seconds_of(seconds):
    """A number, or a clock's reading (an EventClock waits for its call's end event)."""
    return seconds if isinstance(seconds, (int, float)) else seconds.seconds()


def record(op, group_name, nbytes, seconds, calls=1):
    """`seconds`: a number, or a clock (EventClock) read later, when stats() is."""
    entry = _table[op][group_name]
    entry["count"] += calls
    entry["bytes"] += int(nbytes)
    if isinstance(seconds, (int, float)):
        entry["seconds"] += seconds
    else:
        unread = _unread[op, group_name]
        unread.append(seconds)
        if len(unread) > _UNREAD_LIMIT:     # a long run that never reads its statistics
            _read(op, group_name, [clock for clock in unread if clock.ready()])
    for watch in _watches:
        if group_name in watch.groups:
            watch.items.append(seconds)


def _read(op, group_name, clocks):
    _table[op][group_name]["seconds"] += sum(clock.seconds() for clock in clocks)
    done = {id(clock) for clock in clocks}
    _unread[op, group_name][:] = [c for c in _unread[op, group_name] if id(c) not in done]


def stats():
    """Counts, bytes and seconds per op and group since the last reset."""
    for (op, group_name), clocks in list(_unread.items()):
        _read(op, group_name, list(clocks))
    return Stats(_table)


def reset_stats():
    _table.clear()
    _unread.clear()


class Watch:
    """The seconds of every call in `groups` from now on, in call order, for timers that take
    the communication inside an interval out of it (timers.py): a mark is a position in that
    order, read later, so no clock is read before its call is long done."""

    def __init__(self, groups):
        self.groups, self.items, self.base = frozenset(groups), [], 0

    def mark(self):
        return self.base + len(self.items)

    def seconds(self, start, stop):
        """Seconds of the calls recorded between two marks."""
        return sum(seconds_of(s) for s in self.items[max(start - self.base, 0):max(stop - self.base, 0)])

    def forget(self, before):
        """Drop the calls before mark `before` (read already)."""
        if before > self.base:
            del self.items[:before - self.base]
            self.base = before


def watch(groups):
    """A Watch of the calls in the named groups, kept while the caller holds it."""
    w = Watch(groups)
    _watches.add(w)
    return w
