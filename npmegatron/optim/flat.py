"""Parameters, gradients and optimizer state end to end in flat arrays, so that an optimizer step
is a few kernels for the whole model rather than a few per parameter: apex's multi_tensor_apply
and Megatron's ParamAndGradBuffer (one buffer of parameters and one of gradients per dtype, the
data-parallel buckets being slices of it)."""


class FlatLayout:
    """Where each parameter lives in flat arrays of `groups` (lists of parameters, laid end to end
    in this order; each group padded with zeros to a multiple of `multiple_of`, which the
    distributed optimizer's reduce-scatter splits evenly). `data` and `grad` stay None until
    `hold_parameters` makes the parameters and their gradients views of two such buffers."""

    def __init__(self, groups, multiple_of=1):
        first = groups[0][0]
        self.xp, self.dtype = first.xp, first.dtype
        self.params, self.spans, self.where = [], [], {}
        offset = 0
        for group in groups:
            start = offset
            for p in group:
                if p.dtype != self.dtype:
                    raise ValueError(f"parameters of one flat layout share a dtype: {p.dtype} beside "
                                     f"{self.dtype}; give each dtype a layout of its own")
                self.where[id(p)] = slice(offset, offset + p.data.size)
                self.params.append(p)
                offset += p.data.size
            offset = start + -(-(offset - start) // multiple_of) * multiple_of
            self.spans.append(slice(start, offset))
        self.size = offset
        self.data = self.grad = None

    def zeros(self, dtype=None):
        return self.xp.zeros(self.size, dtype or self.dtype)

    def view(self, flat, p):
        """p's part of a flat array of this layout, in p's shape."""
        return flat[self.where[id(p)]].reshape(p.shape)

    def mask(self, predicate):
        """A flat boolean array: True on the elements of the parameters `predicate` holds for."""
        import numpy
        host = numpy.zeros(self.size, bool)
        for p in self.params:
            host[self.where[id(p)]] = bool(predicate(p))
        return self.xp.asarray(host)

    def hold_parameters(self, data_dtype=None):
        """Move every parameter's values into one flat buffer (`data`, of `data_dtype`, by default
        the parameters'; p.data becomes its view) and give the gradients one too (`grad`, of the
        parameters' dtype; `gather_grads` points p.grad at its view). Under --fp16/--bf16 on a GPU
        `data` is 16-bit: the weights forward reads, beside the optimizer's float32 masters."""
        self.data, self.grad = self.zeros(data_dtype), self.zeros()
        for p in self.params:
            view = self.view(self.data, p)
            view[...] = p.data
            p.data = view
        self.grad_views = {id(p): self.view(self.grad, p) for p in self.params}

    def gather_grads(self):
        """Every gradient into its view of `grad`: a copy only for those that were replaced since
        backward wrote them there (sequence-parallel sums over TP, the tied embedding's over the
        pipeline ends); a parameter without a gradient gets zeros."""
        for p in self.params:
            view = self.grad_views[id(p)]
            if p.grad is view:
                continue
            if p.grad is None:
                view.fill(0)
            else:
                view[...] = p.grad
            p.grad = view

    def counted_runs(self, region, skip=(), split=False):
        """Slices of `region` (a slice of this layout) that hold only parameters not in `skip` (ids),
        each as long as possible, or with `split` one a parameter: the parts a gradient norm sums
        (padding between them is zeros)."""
        runs, start, stop = [], None, None
        for p in self.params:
            where = self.where[id(p)]
            lo, hi = max(region.start, where.start), min(region.stop, where.stop)
            if lo >= hi:
                continue
            if split and start is not None:
                runs.append(slice(start, stop))
                start = None
            if id(p) in skip:
                if start is not None:
                    runs.append(slice(start, stop))
                start = None
            else:
                start, stop = (lo if start is None else start), hi
        return runs + ([slice(start, stop)] if start is not None else [])
