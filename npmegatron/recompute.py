"""Which layers recompute their activations in backward, with Megatron's flags
(--recompute-granularity, --recompute-method, --recompute-num-layers; Korthikanti et al. 2022):

- full, uniform, N: the layers of a model chunk (a pipeline stage, or one virtual stage of it) go
  in consecutive chunks of N; each chunk keeps only its input and runs again in backward. N must
  divide the chunk's layer count.
- full, block, N: the first N layers of each model chunk each keep only their input; the rest keep
  everything (Megatron's way to spend spare memory on fewer recomputations).
- selective: only the attention core (scores, softmax, dropout mask) is recomputed. Blockwise
  attention (autograd/ops/attention.py) never keeps them in the first place, so this is what every
  layer already does and nothing changes.

Recomputation runs only while training with the tape on: evaluation and generation never keep
activations, and a KV cache is never recomputed.
"""
from .autograd import InputError, recompute


def recompute_segments(cfg, num_layers):
    """[(first, stop, again)] covering layers 0..num_layers of one model chunk, in order."""
    if cfg.recompute_granularity != "full" or num_layers == 0:
        return [(0, num_layers, False)]
    count = cfg.recompute_num_layers or 1
    if (cfg.recompute_method or "uniform") == "block":
        count = min(count, num_layers)
        return [(i, i + 1, True) for i in range(count)] + ([(count, num_layers, False)] if count < num_layers else [])
    if num_layers % count:
        raise InputError(f"--recompute-num-layers {count} does not divide the {num_layers} layers of a "
                         f"pipeline stage; choose a divisor of {num_layers} or --recompute-method block")
    return [(i, i + count, True) for i in range(0, num_layers, count)]


def run_layers(blocks, x, segments, rng):
    """x through `blocks` (a model chunk's layers in order), recomputing the segments that say so;
    rng: the dropout generator whose position the recomputation replays."""
    for first, stop, again in segments:
        chunk = blocks[first:stop]
        if again:
            x = recompute(lambda h, chunk=chunk: _through(chunk, h), x, rng.replay)
        else:
            x = _through(chunk, x)
    return x


def _through(blocks, x):
    for block in blocks:
        x = block(x)
    return x
