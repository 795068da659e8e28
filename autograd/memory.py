"""How many bytes the autograd tape holds: arrays saved for backward by the nodes reachable
from some outputs, grouped by Function. Views count their base buffer once."""


def _arrays(ctx):
    values = list(ctx.kept or ()) + list(vars(ctx).values())     # as kept: not cast back
    for v in values:
        if hasattr(v, "nbytes") and hasattr(v, "shape"):
            yield v


def root_buffer(a):
    """The array that owns the memory `a` views (a itself when it owns its own)."""
    while getattr(a, "base", None) is not None:
        a = a.base
    return a


def distinct_bytes(arrays):
    """The bytes of the buffers under `arrays`, each buffer once (views count their base)."""
    return sum({id(root): root.nbytes for root in map(root_buffer, arrays)}.values())


def saved_bytes_by_function(tensors, exclude=()):
    """{Function name: bytes of distinct buffers its nodes keep for backward}; `exclude`: arrays
    not to count (e.g. the parameters, which the tape references but does not own)."""
    totals, seen_buffers, seen_nodes = {}, {id(a) for a in exclude}, set()
    stack = [t.grad_fn for t in tensors if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if id(node) in seen_nodes:
            continue
        seen_nodes.add(id(node))
        ctx = getattr(node, "ctx", None)
        if ctx is not None:
            for a in _arrays(ctx):
                base = root_buffer(a)
                if id(base) not in seen_buffers:
                    seen_buffers.add(id(base))
                    totals[node.name] = totals.get(node.name, 0) + base.nbytes
        stack.extend(edge[0] for edge in node.edges if edge is not None)
    return totals
