"""backward(): walk the tape in reverse topological order, iteratively (no recursion limit).

The explicit-gradient form `backward(tensors, grad_tensors)` never reads the outputs' data, so a
pipeline stage may free an output after sending it and still backpropagate through its graph
(Megatron's `deallocate_output_tensor` + `custom_backward`).
"""
from .backend import get_array_module
from .precision import format_of, to_float32
from .errors import InputError
from .graph import AccumulateGrad, edge_of


def _count_consumers(roots):
    """How many edges point at each node reachable from the roots (Kahn's in-degrees)."""
    consumers = {}
    seen = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        for edge in node.edges:
            if edge is not None:
                child = edge[0]
                consumers[child] = consumers.get(child, 0) + 1
                stack.append(child)
    return consumers


def _is_tensor(x):
    """A Tensor, known by its tape attribute (tensor.py imports this module, not the reverse)."""
    return hasattr(x, "grad_fn")


def _seed(t, g):
    if g is None:
        if t.data.size != 1:
            raise InputError(f"backward() on a tensor of shape {tuple(t.shape)} needs an explicit "
                             "gradient: pass one of the same shape, or reduce it to a scalar first "
                             "(e.g. .sum())")
        return get_array_module(t.data).ones_like(t.data)
    return g.data if _is_tensor(g) else g


def backward(tensors, grad_tensors=None):
    """Accumulate d(sum_i <grad_i, tensor_i>)/d(leaf) into every leaf's `.grad`.

    `grad_tensors` may be omitted for scalar outputs. Saved arrays and intermediate gradients are
    dropped as soon as they are used, so the graph can be walked only once.
    """
    if _is_tensor(tensors):
        tensors = [tensors]
    if grad_tensors is None:
        grad_tensors = [None] * len(tensors)
    elif not isinstance(grad_tensors, (list, tuple)):
        grad_tensors = [grad_tensors]
    if len(grad_tensors) != len(tensors):
        raise InputError(f"backward() got {len(tensors)} tensors but {len(grad_tensors)} gradients; "
                         "pass one gradient per tensor")

    buffers = {}     # node -> list of gradients, one slot per output
    roots = []
    for t, g in zip(tensors, grad_tensors):
        if not t.requires_grad:
            raise InputError("backward() on a tensor that does not require grad: no parameter "
                             "it depends on has requires_grad=True")
        g = _seed(t, g)
        if t.grad_fn is None:
            node, index = t._accumulator or _make_accumulator(t), 0
        else:
            node, index = t.grad_fn, t.output_index
        _accumulate(buffers, node, index, g)
        roots.append(node)

    consumers = _count_consumers(roots)
    ready = [n for n in dict.fromkeys(roots) if consumers.get(n, 0) == 0]
    owned = {}       # id -> gradient array no one but this walk holds (kept alive, so ids stay unique)
    while ready:
        node = ready.pop()
        grads = buffers.pop(node)
        # a node may pass an incoming gradient on (Add gives it to both inputs): owned no more
        mine = [owned.pop(id(g), None) is not None for g in grads if g is not None]
        if isinstance(node, AccumulateGrad):
            results, summed = node.run(grads, adopt=all(mine)), ()
        else:
            function = getattr(node, "function", None)
            pending = (_pending(buffers, node, owned, consumers) if getattr(function, "adds_pending_grads", False)
                       else None)
            destinations = (_destinations(buffers, node, consumers) if getattr(function, "writes_grad_destinations", False)
                            else None)
            results = node.run(grads, pending, destinations) if pending or destinations else node.run(grads)
            summed = set(getattr(node, "summed_pending", ()))
            if destinations:
                summed.update([i for i, (d, g) in enumerate(zip(destinations, results))
                               if d is not None and g is d[0]])
        # a view of an incoming gradient this walk alone held is this walk's alone too (Transpose)
        passed_on = getattr(getattr(node, "function", None), "passes_gradient_views", False) and all(mine)
        for position, (edge, g) in enumerate(zip(node.edges, results)):
            if edge is None:
                continue
            child, index = edge
            if g is not None and position in summed:
                _replace(buffers, child, index, g, owned)
            elif g is not None:
                fresh = passed_on or position in getattr(node, "fresh_grads", ())
                _accumulate(buffers, child, index, g, owned, fresh)
            consumers[child] -= 1
            if consumers[child] == 0:
                if child in buffers:
                    ready.append(child)
                else:
                    _release(child, consumers, ready, buffers)


def _release(node, consumers, ready, buffers):
    """A node no gradient reached: free its saved arrays and release its inputs in turn."""
    stack = [node]
    while stack:
        n = stack.pop()
        if getattr(n, "ctx", None) is not None:
            n.ctx = None
        for edge in n.edges:
            if edge is None:
                continue
            child = edge[0]
            consumers[child] -= 1
            if consumers[child] == 0:
                (ready.append(child) if child in buffers else stack.append(child))


def _make_accumulator(t):
    return edge_of(t)[0]


def _pending(buffers, node, owned, consumers):
    """(per input of `node`, the gradient its producer has accumulated so far, or None; per
    input, whether this walk alone holds that gradient, so backward may add to it in place; per
    input, whether that gradient is complete but for node's own: node is its last consumer)."""
    pending = []
    for edge in node.edges:
        slots = buffers.get(edge[0]) if edge is not None else None
        pending.append(slots[edge[1]] if slots is not None else None)
    complete = tuple(edge is not None and consumers.get(edge[0]) == 1 for edge in node.edges)
    return tuple(pending), tuple(g is not None and id(g) in owned for g in pending), complete


def _destinations(buffers, node, consumers):
    """Per input of `node`: (main_grad, accumulate) where its gradient may be written straight
    into the leaf's flat gradient buffer, else None. Offered where that array ends up holding the
    very sum the engine would make, added in the engine's order: to overwrite when the leaf has
    no gradient yet, from this walk or an earlier one; to add to when main_grad holds this walk's
    gradient so far (another Function wrote it there), or an earlier walk's when this is the
    walk's last contribution (the engine adds a walk's contributions together first)."""
    out = []
    for edge in node.edges:
        where = None
        if edge is not None and isinstance(edge[0], AccumulateGrad) and edge[0].leaf.main_grad is not None:
            leaf, slots = edge[0].leaf, buffers.get(edge[0])
            held, main = (slots[0] if slots else None), edge[0].leaf.main_grad
            if held is None and leaf.grad is None:
                where = (main, False)
            elif (held is main and leaf.grad is None) or \
                    (held is None and leaf.grad is main and consumers[edge[0]] == 1):
                where = (main, True)
        out.append(where)
    return tuple(out) if any(out) else None


def _replace(buffers, node, index, g, owned):
    """The slot becomes g, a fresh array that already includes the slot's gradient
    (Context.sum_pending)."""
    slots = buffers.get(node)
    if slots is None:
        slots = buffers[node] = [None] * getattr(node, "n_outputs", 1)
    if slots[index] is not None:
        owned.pop(id(slots[index]), None)
    slots[index] = g
    owned[id(g)] = g


def _accumulate(buffers, node, index, g, owned=None, fresh=False):
    """Add g into the node's slot. `owned` records which slot arrays only this walk holds: a fresh
    gradient (Context.mark_fresh) and every sum made here; an AccumulateGrad takes those as its
    leaf's .grad without a copy (one kernel a parameter on a GPU)."""
    slots = buffers.get(node)
    if slots is None:
        slots = buffers[node] = [None] * getattr(node, "n_outputs", 1)
    if slots[index] is None:
        slots[index] = g
    elif isinstance(node, AccumulateGrad) and slots[index] is node.leaf.main_grad:
        slots[index] += g       # a Function wrote there (_destinations): it keeps the whole sum
        return
    elif owned is not None and id(slots[index]) in owned and slots[index].shape == g.shape \
            and slots[index].dtype == g.dtype and getattr(node, "storage", None) is None \
            and format_of(g.dtype) is None:
        # the slot's array is this walk's alone: no new array, no copy. Not where the gradient
        # flows into a 16-bit Function: its producer may have kept a 16-bit copy of the array
        # (function.py), which an in-place sum would leave stale.
        slots[index] += g
        return
    else:
        if owned is not None:
            owned.pop(id(slots[index]), None)
        # out of place: g may be shared with another consumer of the same backward result. Two
        # 16-bit gradients (a GPU's) are summed in float32, as the CPU's emulation sums them
        held = slots[index]
        if format_of(held.dtype) and format_of(g.dtype):
            held = to_float32(held)
        slots[index] = g = held + g
        fresh = True
    if fresh and owned is not None:
        owned[id(g)] = g
