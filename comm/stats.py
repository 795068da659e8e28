"""Accounting: every collective and point-to-point call records op, group, bytes and seconds.

Bytes are what this rank hands to the call (its input buffer), so counts and volumes can be held
against the paper's (2 all-reduces forward and 2 backward per transformer layer).
"""
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


def record(op, group_name, nbytes, seconds, calls=1):
    entry = _table[op][group_name]
    entry["count"] += calls
    entry["bytes"] += int(nbytes)
    entry["seconds"] += seconds


def stats():
    """Counts, bytes and seconds per op and group since the last reset."""
    return Stats(_table)


def reset_stats():
    _table.clear()
