"""Rank program for tests/npmegatron/test_context_parallel.py: a GPT whose sequences are split over
a context-parallel group equals the serial model in float64 (loss, logits gathered back into
sequence order, every gradient), and its ring sends what ring attention should.

    mpiexec -n N python tests/ranks/context_parallel.py equals-serial CP TP
        both model families at CP x TP = N (TP with and without sequence parallelism); rank 0
        prints one JSON line per case
    mpiexec -n N python tests/ranks/context_parallel.py counts
        the CP group's sends per layer at CP = N, forward and backward; rank 0 prints a JSON line
"""
import argparse
import json

import numpy as np

import npmegatron.autograd as ag
from npmegatron import comm
from npmegatron.context_parallel import local_positions
from npmegatron.model import GPT, GPTConfig

FAMILIES = {"gpt2": {}, "llama": dict(model_family="llama", num_attention_heads=8, group_query_attention=True,
                                      num_query_groups=2, ffn_hidden_size=40)}


def config(family, **kw):
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=50, max_position_embeddings=16,
                dtype="float64", hidden_dropout=0.0, attention_dropout=0.0)
    return GPTConfig(**{**base, **FAMILIES[family], **kw})


def batch(b=2, t=16, vocab=50, seed=0):
    ids = np.random.default_rng(seed).integers(0, vocab, (b, t + 1))
    return ids[:, :-1], ids[:, 1:]


def rel(a, b):
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-300))


def sequence_order(local, grid, axis=1):
    """The CP group's local arrays (tokens on `axis`) gathered back into sequence order."""
    whole = comm.all_gather(local, grid.cp_group, axis=axis)
    order = np.concatenate([local_positions(whole.shape[axis], r, grid.cp_size) for r in range(grid.cp_size)])
    out = np.empty_like(whole)
    out[(slice(None),) * axis + (order,)] = whole
    return out


def equals_serial(world, cp, tp):
    grid = comm.ProcessGrid(tp=tp, cp=cp)
    ids, targets = batch()
    variants = [(family, sp, None) for family in FAMILIES for sp in ((False, True) if tp > 1 else (False,))]
    variants += [(family, False, "full") for family in FAMILIES]       # backward runs the ring forward again
    for family, sp, recompute in variants:
        serial = GPT(config(family))
        model = GPT(config(family, sequence_parallel=sp, recompute_granularity=recompute), grid)
        logits_s, loss_s = serial(ids, targets)
        logits_p, loss_p = model(ids, targets)
        loss_s.backward()
        loss_p.backward()
        model.finalize_grads()
        loss = comm.all_reduce(np.array([loss_p.item()]), grid.cp_group)[0] / cp
        worst = {"loss": rel(np.array(loss), np.array(loss_s.item())),
                 "logits": rel(sequence_order(model.full_logits(logits_p), grid), serial.full_logits(logits_s))}
        serial_grads = {name: p.grad for name, p in serial.named_parameters()}
        for name, param, spec in model.named_specs():
            grad = comm.all_reduce(param.grad, grid.cp_group) / cp    # the DP x CP average's CP part
            if spec.tp_axis is not None:
                grad = comm.all_gather(grad, grid.tp_group, axis=spec.tp_axis)
            cut = tuple(slice(0, n) for n in spec.shape)
            worst[name] = rel(grad[cut], serial_grads[name][cut])
        bad = {k: v for k, v in worst.items() if not v < 1e-10}
        assert not bad, (family, sp, bad)
        if world.rank == 0:
            print(json.dumps({"family": family, "cp": cp, "tp": tp, "sp": sp, "recompute": recompute,
                              "checked": len(worst),
                              "max_rel_error": max(worst.values())}), flush=True)


def counts(world):
    """Sends in the CP group per layer: forward passes every other rank's key/value block once
    (CP - 1); backward passes them again and their gradients one step further home (2 CP - 1)."""
    grid = comm.ProcessGrid(cp=world.size)

    def sends(layers):
        model = GPT(config("llama", num_layers=layers), grid)
        ids, targets = batch()
        comm.reset_stats()
        _, loss = model(ids, targets)
        forward = comm.stats()
        comm.reset_stats()
        loss.backward()
        backward = comm.stats()
        return [forward.count("send", "cp"), backward.count("send", "cp"), forward.bytes("send", "cp")]

    one, two = sends(1), sends(2)
    if world.rank == 0:
        print(json.dumps({"cp": world.size, "per_layer": [b - a for a, b in zip(one, two)],
                          "one_layer_model": one}), flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("case", choices=["equals-serial", "counts"])
    parser.add_argument("sizes", nargs="*", type=int)
    args = parser.parse_args(argv)
    world = comm.init()
    if args.case == "equals-serial":
        equals_serial(world, *args.sizes)
    else:
        counts(world)


if __name__ == "__main__":
    main()
