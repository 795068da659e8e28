"""Rank program for tests/npmegatron/test_tensor_parallel.py: tensor and sequence parallelism
against the serial model (float64), communication counts, Megatron's cross-entropy values, the
RNG tracker's dropout masks and the tape bytes sequence parallelism saves. Every case runs on a
TP group of the whole world (TP = number of ranks).

    mpiexec -n 4 python tests/ranks/tensor_parallel.py adjoint        # test_mappings_are_adjoint_pairs
    mpiexec -n N python tests/ranks/tensor_parallel.py equals-serial  # test_tensor_parallel_equals_serial
    mpiexec -n 2 python tests/ranks/tensor_parallel.py equals-serial-qkv-bias
                                                # test_convert_moe.py's test_the_qkv_bias_at_tp2_equals_serial
    mpiexec -n N python tests/ranks/tensor_parallel.py equals-serial-shared-memory
                                                # test_tensor_parallel_through_shared_memory_equals_serial
    mpiexec -n 2 python tests/ranks/tensor_parallel.py counts
                                                # test_communication_per_layer_matches_the_paper
    mpiexec -n 2 python tests/ranks/tensor_parallel.py cross-entropy-volume
                                                # test_cross_entropy_communication_does_not_grow_with_the_vocabulary
    mpiexec -n 2 python tests/ranks/tensor_parallel.py cross-entropy-extreme-shards
                                                # test_compiled_float32_loss_with_extreme_shards
    mpiexec -n 4 python tests/ranks/tensor_parallel.py megatron-cross-entropy
                                                # test_megatron_cross_entropy_reference_values
    mpiexec -n 2 python tests/ranks/tensor_parallel.py dropout-masks  # test_dropout_masks_follow_the_rng_tracker
    mpiexec -n 4 python tests/ranks/tensor_parallel.py tape-bytes
                                                # test_sequence_parallel_cuts_layernorm_and_dropout_tape_bytes
Results the tests check are printed (JSON lines on rank 0, or a marker line).
"""
import argparse
import json

import numpy as np

import npmegatron.autograd as ag
from npmegatron import comm
from npmegatron.model import GPT, GPTConfig


#: The Llama family at test size: RMSNorm, rotary, SwiGLU, untied, no biases, and grouped-query
#: attention with 4 key/value groups of 2 query heads (TP 4 holds one group per rank).
LLAMA = dict(model_family="llama", hidden_size=32, num_attention_heads=8, group_query_attention=True,
             num_query_groups=4, ffn_hidden_size=40)


def config(**kw):
    base = dict(num_layers=2, hidden_size=16, num_attention_heads=4, vocab_size=50,
                max_position_embeddings=8, dtype="float64", hidden_dropout=0.0, attention_dropout=0.0)
    base.update(kw)
    return GPTConfig(**base)


def batch(b=2, t=8, vocab=50, seed=0):
    ids = np.random.default_rng(seed).integers(0, vocab, (b, t + 1))
    return ids[:, :-1], ids[:, 1:]


def full(model, param, spec, grad=True):
    """A parameter's (or its gradient's) whole master array: TP shards gathered, padding cut."""
    data = param.grad if grad else param.data
    if spec.tp_axis is not None:
        data = comm.all_gather(data, model.tp_group, axis=spec.tp_axis)
    return data[tuple(slice(0, n) for n in spec.shape)]


def rel(a, b):
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-300))


def adjoint(world, grid):
    """<y, F(x)> = <F*(y), x>, where F* is F's backward. Replicated spaces (R) count once;
    distributed ones (D: per-rank copies or shards) sum over ranks."""
    from npmegatron import tensor_parallel as tp
    g = grid.tp_group
    n = g.size
    B, S, H = 2, 8, 12
    table = [  # (mapping, input space, input shape, output space)
        (tp.copy_to_tp_region, "R", (B, S, H), "D"),
        (tp.reduce_from_tp_region, "D", (B, S, H), "R"),
        (tp.scatter_to_tp_region, "R", (B, S, H), "D"),
        (tp.gather_from_tp_region, "D", (B, S, H // n), "R"),
        (tp.scatter_to_sp_region, "R", (B, S, H), "D"),
        (tp.gather_from_sp_region, "D", (B, S // n, H), "D"),
        (tp.reduce_scatter_to_sp_region, "D", (B, S, H), "D"),
    ]

    def draw(space, shape, seed):
        rng = np.random.default_rng(seed if space == "R" else seed + 1000 * (g.rank + 1))
        return rng.standard_normal(shape)

    def inner(space, a, b):
        local = np.array([float((a * b).sum())])
        return local[0] if space == "R" else float(comm.all_reduce(local, g)[0])

    for mapping, space_in, shape, space_out in table:
        x = ag.Tensor(draw(space_in, shape, 1), requires_grad=True)
        out = mapping(x, g)
        y = draw(space_out, out.shape, 2)
        ag.backward([out], [y])
        lhs, rhs = inner(space_out, y, out.data), inner(space_in, x.grad, x.data)
        assert abs(lhs - rhs) <= 1e-12 * abs(lhs), (mapping.__name__, lhs, rhs)
        assert mapping.__doc__.count("forward:") == 1 and "backward:" in mapping.__doc__
    print("adjoint ok")


def equals_serial(world, grid, family=None):
    """Loss, logits, parameters and every gradient equal the serial model's, without and with
    sequence parallelism; rank 0 prints one JSON line for each."""
    for sp in (False, True):
        model, worst = compare_with_serial(grid, batch(), sequence_parallel=sp, **(family or {}))
        if world.rank == 0:
            print(json.dumps({"tp": world.size, "sp": sp, "padded_vocab": model.padded_vocab_size,
                              "parameters": sorted(worst)[:4], "max_rel_error": max(worst.values())}))


def equals_serial_through_shared_memory(world, grid):
    """As equals-serial, with activations of 64 KiB (2 x 32 tokens x 128 float64): large enough
    for comm's shared-memory all-reduce, which the TP all-reduces then take."""
    model, worst = compare_with_serial(grid, batch(t=32), hidden_size=128, max_position_embeddings=32)
    channel = grid.tp_group.shared_memory
    assert channel and channel.calls >= 4 * 2, "the TP all-reduces did not take shared memory"
    if world.rank == 0:
        print(json.dumps({"tp": world.size, "shared_memory_calls": channel.calls,
                          "max_rel_error": max(worst.values())}))


def compare_with_serial(grid, ids_targets, **config_fields):
    """(the TP model, worst relative error per quantity) after one forward and backward."""
    ids, targets = ids_targets
    serial = GPT(config(**{k: v for k, v in config_fields.items() if k != "sequence_parallel"}),
                 comm.ProcessGrid.single())
    model = GPT(config(**config_fields), grid)
    logits_s, loss_s = serial(ids, targets)
    logits_p, loss_p = model(ids, targets)
    loss_s.backward()
    loss_p.backward()
    model.finalize_grads()
    worst = {"loss": rel(np.array(loss_p.item()), np.array(loss_s.item())),
             "logits": rel(model.full_logits(logits_p), serial.full_logits(logits_s))}
    serial_specs = {name: (p, spec) for name, p, spec in serial.named_specs()}
    for name, param, spec in model.named_specs():
        p_s, spec_s = serial_specs[name]
        worst[name] = rel(full(model, param, spec), full(serial, p_s, spec_s))
        assert np.array_equal(full(model, param, spec, grad=False),
                              full(serial, p_s, spec_s, grad=False)), name
    bad = {k: v for k, v in worst.items() if not v < 1e-10}
    assert not bad, (config_fields, bad)
    return model, worst


def equals_serial_compiled_loss(world, grid):
    """equals-serial with the loss's compiled CPU passes (_cross_entropy_cpu.py) on every shard,
    the targets of other ranks' shards included."""
    import npmegatron.tensor_parallel.cross_entropy as ce
    ce.COMPILED_CROSS_ENTROPY_SIZE = 1
    equals_serial(world, grid)


def counts(world, grid, family=None):
    """TP collectives per layer, forward and backward, without and with sequence parallelism:
    rank 0 prints one JSON line for each."""
    def count(layers, sp):
        model = GPT(config(num_layers=layers, sequence_parallel=sp, **(family or {})), grid)
        ids, targets = batch()
        comm.reset_stats()
        _, loss = model(ids, targets)
        forward = comm.stats()
        comm.reset_stats()
        loss.backward()
        backward = comm.stats()
        return {op: (forward.count(op, "tp"), backward.count(op, "tp"))
                for op in ("all_reduce", "all_gather", "reduce_scatter")}

    for sp in (False, True):
        one, two = count(1, sp), count(2, sp)
        per_layer = {op: (two[op][0] - one[op][0], two[op][1] - one[op][1]) for op in one}
        if world.rank == 0:
            print(json.dumps({"sp": sp, "per_layer": per_layer, "one_layer_model": one}))


def cross_entropy_volume(world, grid):
    """The vocabulary-parallel cross entropy's traffic is the same for 128 and 4096 words."""
    from npmegatron.tensor_parallel import vocab_parallel_cross_entropy
    g = grid.tp_group
    tokens = 2 * 8
    volumes = []
    for vocab in (128, 4096):
        local = vocab // g.size
        logits = ag.Tensor(np.random.default_rng(g.rank).standard_normal((2, 8, local)), requires_grad=True)
        targets = np.random.default_rng(0).integers(0, vocab, (2, 8))
        comm.reset_stats()
        loss = vocab_parallel_cross_entropy(logits, targets, g, g.rank * local, vocab)
        loss.backward()
        s = comm.stats()
        volumes.append((s.count("all_reduce", "tp"), s.bytes("all_reduce", "tp"), s.count("all_gather")))
    assert volumes[0] == volumes[1] == (3, 3 * tokens * 8, 0), volumes
    print("volumes", volumes)


def cross_entropy_extreme_shards(world, grid):
    """The compiled loss in float32 on every shard (_cross_entropy_cpu.py: each shard's
    exponentials shifted by its own maximum, rescaled after the all-reduce), with a row where
    rank 0's shard is all -inf, one where every other shard lies 150 below rank 0's maximum (its
    rescale underflows to 0) and one far below zero: the full vocabulary's float64 loss and
    gradient to float32 round-off, and no NumPy warning."""
    import warnings
    import npmegatron.tensor_parallel.cross_entropy as ce
    from npmegatron.tensor_parallel import vocab_parallel_cross_entropy
    g = grid.tp_group
    rows, local = 64, 4096
    vocab = local * g.size
    rng = np.random.default_rng(0)
    full = rng.standard_normal((rows, vocab)) * 3
    full[0, :local] = -np.inf
    full[1, local:] -= 150
    full[2] -= 200
    targets = rng.integers(0, vocab, rows)
    targets[0] = local + 3                  # a word of a shard that is not -inf
    columns = slice(g.rank * local, (g.rank + 1) * local)
    shard = full[:, columns].astype(np.float32)
    assert ce._compiled(shard, local)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        x = ag.Tensor(shard[None], requires_grad=True)
        losses = vocab_parallel_cross_entropy(x, targets[None], g, g.rank * local, vocab, reduction="none")
        losses.backward(np.ones(losses.shape, np.float32))
    top = full.max(axis=1, keepdims=True)
    softmax = np.exp(full - top) / np.exp(full - top).sum(axis=1, keepdims=True)
    want = np.log(np.exp(full - top).sum(axis=1)) + top[:, 0] - full[np.arange(rows), targets]
    grad = softmax.copy()
    grad[np.arange(rows), targets] -= 1
    assert np.isfinite(losses.data).all() and np.isfinite(x.grad).all()
    np.testing.assert_allclose(losses.data[0], want, rtol=1e-5)
    np.testing.assert_allclose(x.grad[0], grad[:, columns], rtol=1e-4, atol=1e-7)
    print("extreme shards ok")


def megatron_cross_entropy(world, grid):
    """Megatron's unit test: on 4 ranks the local logits are arange(8) repeated to 32 columns
    (vocabulary 128); 16 tokens with targets 0, 2, ..., 30."""
    from npmegatron.tensor_parallel import vocab_parallel_cross_entropy
    g = grid.tp_group
    logits = ag.Tensor(np.tile(np.arange(8.0), 4)[None, None, :].repeat(16, axis=1))
    targets = np.arange(0, 32, 2)[None, :]
    losses = vocab_parallel_cross_entropy(logits, targets, g, g.rank * 32, 128, reduction="none")
    expected = np.tile([10.2309, 8.2309, 6.2309, 4.2309], 4)
    assert np.allclose(losses.data[0], expected, atol=1e-4), losses.data
    exact = np.log(16 * np.exp(np.arange(8.0)).sum()) - (np.arange(0, 32, 2) % 8)
    assert np.allclose(losses.data[0], exact, rtol=1e-12)
    print("megatron values ok", np.round(losses.data[0][:4], 4).tolist())


def dropout_masks(world, grid):
    """Residual/embedding dropout masks are identical across TP ranks; attention-probability
    masks (different heads per rank) differ. The masks are read off the autograd tape."""
    model = GPT(config(hidden_dropout=0.3, attention_dropout=0.3), grid)
    ids, targets = batch()
    _, loss = model(ids, targets)
    masks = {"hidden": [], "attention": []}
    stack, seen = [loss.grad_fn], set()
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if node.name in ("Dropout", "DropoutAdd", "BiasDropoutAdd"):    # the last two: + residual
            masks["hidden"].append(node.ctx.saved[0])
        if node.name in ("CausalAttention", "PackedCausalAttention"):   # no mask kept: drawn again
            saved = node.ctx.saved
            q, k = node.ctx.split_qkv(saved[0])[:2] if node.name == "PackedCausalAttention" else saved[:2]
            shape = q.shape[:3] + k.shape[2:3]
            masks["attention"].append(node.ctx.generator.random(shape, q.dtype) >= node.ctx.p)
        stack.extend(e[0] for e in node.edges if e is not None)
    assert len(masks["hidden"]) == 1 + 2 * 2 and len(masks["attention"]) == 2
    for kind, arrays in masks.items():
        for keep in arrays:
            both = comm.all_gather(keep.astype(np.int8)[None], grid.tp_group, axis=0)
            same = np.array_equal(both[0], both[1])
            assert same == (kind == "hidden"), (kind, same)
    first = model.rng.site("default", 0).random(3)
    model(ids, targets)                      # drawing again changes no position: the same masks
    assert np.array_equal(model.rng.site("default", 0).random(3), first)
    print("masks ok")


def tape_bytes(world, grid):
    """Bytes the LayerNorm and Dropout nodes save, without and with sequence parallelism:
    rank 0 prints them as one JSON line."""
    from npmegatron.autograd.memory import saved_bytes_by_function
    row = {}
    for sp in (False, True):
        model = GPT(config(num_layers=2, hidden_size=32, num_attention_heads=4, max_position_embeddings=16,
                           hidden_dropout=0.1, attention_dropout=0.0, sequence_parallel=sp), grid)
        ids, targets = batch(b=2, t=16)
        _, loss = model(ids, targets)
        saved = saved_bytes_by_function([loss])
        row[sp] = {"LayerNorm": saved["LayerNorm"],
                   "Dropout": saved["Dropout"] + saved.get("DropoutAdd", 0) + saved.get("BiasDropoutAdd", 0)}
    if world.rank == 0:
        print(json.dumps({"tp": world.size, "without_sp": row[False], "with_sp": row[True]}))
    for fn in ("LayerNorm", "Dropout"):
        ratio = row[False][fn] / row[True][fn]
        assert 0.9 * world.size <= ratio <= 1.1 * world.size, (fn, ratio)


CASES = {"adjoint": adjoint, "equals-serial": equals_serial,
         "equals-serial-llama": lambda world, grid: equals_serial(world, grid, LLAMA),
         "counts-llama": lambda world, grid: counts(world, grid, LLAMA),
         "equals-serial-qkv-bias": lambda world, grid: equals_serial(world, grid, {**LLAMA, "add_qkv_bias": True}),
         "equals-serial-compiled-loss": lambda world, grid: equals_serial_compiled_loss(world, grid),
         "equals-serial-shared-memory": equals_serial_through_shared_memory, "counts": counts,
         "cross-entropy-volume": cross_entropy_volume, "megatron-cross-entropy": megatron_cross_entropy,
         "cross-entropy-extreme-shards": cross_entropy_extreme_shards,
         "dropout-masks": dropout_masks, "tape-bytes": tape_bytes}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("case", choices=sorted(CASES))
    case = parser.parse_args(argv).case
    world = comm.init()
    grid = comm.ProcessGrid(tp=world.size)
    CASES[case](world, grid)


if __name__ == "__main__":
    main()
