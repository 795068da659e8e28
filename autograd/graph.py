"""The tape's leaf nodes and edges: what a recorded call points back to. Below both function.py
(which records calls) and engine.py (which walks them back), so neither imports the other; a
tensor is recognised by its `requires_grad` and `grad_fn`, not by importing tensor.py, which in
turn calls the engine from Tensor.backward.
"""


class AccumulateGrad:
    """The tape node of a leaf tensor: adds the incoming gradient into `tensor.grad`."""

    name = "AccumulateGrad"

    def __init__(self, leaf):
        self.leaf = leaf
        self.edges = ()
        self.hooks = []

    def run(self, grads, adopt=False):
        (g,) = grads
        leaf = self.leaf
        # The first gradient is copied: backward functions may hand the same array to several
        # inputs, and a leaf's grad must be its own (optimizers and all-reduces write into it),
        # unless the engine knows no one else holds it (`adopt`: engine._accumulate). Later ones
        # are added in place: grad may be a view into a data-parallel bucket.
        # A Function that wrote straight into the leaf's main_grad (engine._destinations) hands
        # that very array on: it already holds the sum.
        if g is leaf.grad or (leaf.grad is None and g is leaf.main_grad):
            leaf.grad = g
        elif leaf.grad is None:
            leaf.grad = g if adopt else g.copy()
        else:
            leaf.grad += g
        for hook in self.hooks:
            hook(leaf)
        return ()


def grad_accumulator(leaf):
    """The AccumulateGrad node of a leaf tensor (created if needed); append to its `hooks` to
    run code as soon as the leaf's gradient of a backward pass is complete."""
    if leaf._accumulator is None:
        leaf._accumulator = AccumulateGrad(leaf)
    return leaf._accumulator


def edge_of(x):
    """(node, output index) a gradient for `x` flows to, or None when none is wanted (a plain
    array, or a tensor that does not require grad)."""
    if not getattr(x, "requires_grad", False):
        return None
    if x.grad_fn is not None:
        return (x.grad_fn, x.output_index)
    return (grad_accumulator(x), 0)
