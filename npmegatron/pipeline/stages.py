"""The stages one pipeline rank holds (one, or several virtual stages for the interleaved
schedule), presented as one Module: parameters under the serial model's names, gradient
finalisation over the tensor-parallel and embedding groups."""
from .. import comm
from ..autograd.backend import array_module_for
from ..model import GPT, dropout_rng, gpt_num_parameters
from ..module import Module


class PipelineModel(Module):
    """This rank's virtual stages i = 0..V-1 (global stages i * PP + pp_rank) as `chunks`, with
    the StageSpec of each in `stage_specs`."""

    def __init__(self, cfg, grid, stages):
        self.cfg, self.grid = cfg, grid
        self.num_stages = len(stages)
        self.virtual_size = self.num_stages // grid.pp_size
        self.xp = array_module_for(cfg.device)
        self.rng = dropout_rng(cfg, grid, self.xp)       # shared by this rank's virtual stages
        self.stage_specs = stages[grid.pp_rank::grid.pp_size]
        self.chunks, wte = [], None
        for spec in self.stage_specs:
            # Embedding and loss on one rank (PP = 1, or virtual stages) share one word embedding.
            chunk = GPT(cfg, grid, spec.layers, spec.pre_process, spec.post_process, self.rng, wte)
            wte = getattr(chunk, "wte", wte)
            self.chunks.append(chunk)
        self.tp_group = grid.tp_group
        holds = lambda attr: any(getattr(s, attr) for s in self.stage_specs)
        # The last stage's copy of the word embedding, when the first stage is another rank; an
        # untied output layer is no copy (--untie-embeddings-and-output-weights).
        tied = not cfg.untie_embeddings_and_output_weights
        self.embedding_copy = wte if tied and holds("post_process") and not holds("pre_process") else None
        self.tied = wte if tied and (holds("pre_process") or holds("post_process")) else None

    def children(self):
        """The stages, unnamed: a parameter keeps its name in the serial model (`blocks.3.…`)
        whatever the split, so checkpoints reshard by name. A word embedding shared by two
        stages is listed once (named_modules skips a module it has seen)."""
        return [("", chunk) for chunk in self.chunks]

    def finalize_grads(self):
        """Sequence-parallel partial gradients summed over TP (per stage), then the two copies of
        the tied word embedding summed over the embedding group (first and last stage)."""
        for chunk in self.chunks:       # the shared embedding is not a partial-gradient parameter
            chunk.finalize_grads()
        if self.tied is not None and self.grid.embedding_group.size > 1:
            weight = self.tied.weight
            weight.grad = comm.all_reduce(weight.grad, self.grid.embedding_group)

    def norm_skip(self):
        """Parameters this rank must leave out of the global gradient norm: replicated ones off
        TP rank 0, and the last stage's copy of the embedding (counted on the first stage)."""
        skip = set()
        if self.grid.tp_rank != 0:
            skip |= {id(p) for _, p, spec in self.named_specs() if spec.tp_axis is None}
        if self.embedding_copy is not None:
            skip.add(id(self.embedding_copy.weight))
        return skip

    def num_parameters(self):
        return gpt_num_parameters(self.cfg)

    @property
    def whole(self):
        """The serial-shaped GPT when this rank holds every layer (PP = 1), else None."""
        spec = self.stage_specs[0]
        if len(self.chunks) == 1 and spec.pre_process and spec.post_process:
            return self.chunks[0]
        return None
