"""Rank program for tests/npmegatron/test_pipeline_parallel.py: pipeline parallelism in float64
against the serial model, and the schedules' memory.

    mpiexec -n N python tests/ranks/pipeline_parallel.py check '<JSON list of cases>'
        test_two_stages_every_schedule_layout_and_variable_lengths (N = 2),
        test_four_ranks_pp4_pp2xtp2_pp2xdp2 (N = 4), test_eight_ranks_pp4xtp2_and_pp2xtp2xdp2 (N = 8).
        A case is {"tp", "pp", "m", "schedule"} with optional "layers", "virtual", "layout",
        "variable", "sp", "overlap", "family" ("llama"), "cp" (with "seq", the sequence length)
        and "device" ("gpu": the pipeline on CuPy arrays, a real GPU's
        or the strict stand-in's, the serial reference on NumPy); every one must give the serial
        model's loss and every gradient to 1e-10 relative. Rank 0 prints "worst relative error
        <float>".
    mpiexec -n 4 python tests/ranks/pipeline_parallel.py memory
        test_schedule_memory_and_deallocated_outputs; rank 0 prints "TABLE <repr of the table>".
"""
import argparse
import dataclasses
import json

import numpy as np


#: A case's "family": GPT-2, or the Llama family with 2 key/value groups of 2 query heads.
FAMILIES = {"gpt2": {}, "llama": dict(model_family="llama", group_query_attention=True, num_query_groups=2,
                                      ffn_hidden_size=24)}


def check(cases):
    import npmegatron.autograd as ag
    from npmegatron import comm
    from npmegatron.autograd.backend import to_numpy
    from npmegatron.config import ParallelConfig, TrainConfig
    from npmegatron.model import GPT, GPTConfig
    from npmegatron.pipeline import default_layout
    from npmegatron.run import assemble
    from npmegatron.training import train_step
    from npmegatron.training.step import sum_losses

    world = comm.init()
    worst = 0.0
    for case in cases:
        layers = case.get("layers", 4)
        seq, cp = case.get("seq", 12), case.get("cp", 1)
        cfg = GPTConfig(num_layers=layers, hidden_size=16, num_attention_heads=4, vocab_size=50,
                        max_position_embeddings=seq, dtype="float64", hidden_dropout=0.0,
                        attention_dropout=0.0, sequence_parallel=case.get("sp", False),
                        **FAMILIES[case.get("family", "gpt2")])
        m, dp = case["m"], world.size // (case["tp"] * case["pp"] * cp)
        rng = np.random.default_rng(7)
        lengths = [4 + 2 * (i % 4) if case.get("variable") else seq for i in range(m * dp)]
        batches = [(ids[:, :-1], ids[:, 1:]) for ids in (rng.integers(0, 50, (2, n + 1)) for n in lengths)]

        serial = GPT(cfg)
        total = 0.0
        for x, y in batches:
            _, loss = serial(x, y)
            ag.backward(loss, np.asarray(1.0 / (m * dp)))
            total += loss.item()
        reference = dict(serial.named_parameters())

        parallel = ParallelConfig(
            tensor_model_parallel_size=case["tp"], pipeline_model_parallel_size=case["pp"], num_micro_batches=m,
            pipeline_model_parallel_layout=case.get("layout") or default_layout(layers, case["pp"], case.get("virtual", 1)),
            pipeline_schedule=case["schedule"], variable_seq_lengths=case.get("variable", False), ddp_bucket_size=3000,
            context_parallel_size=cp)
        run = assemble(TrainConfig(model=dataclasses.replace(cfg, device=case.get("device", "cpu")), parallel=parallel,
                                   seq_length=seq, micro_batch_size=2))
        grid, model = run.grid, run.model
        mine = batches[grid.dp_rank * m:(grid.dp_rank + 1) * m]
        loss_sum = train_step(model, run.exchange, mine, run.buckets, run.schedule, overlap=case.get("overlap", True))
        loss = to_numpy(sum_losses(model, loss_sum))[0] / (m * dp)     # over PP, DP and CP
        errors = [abs(loss - total / (m * dp)) / abs(total / (m * dp))]
        for name, param, spec in model.named_specs():
            grad = param.grad
            if spec.tp_axis is not None:
                grad = comm.all_gather(grad, grid.tp_group, axis=spec.tp_axis)
            grad = to_numpy(grad)
            cut = tuple(slice(0, n) for n in spec.shape)
            want = reference[name].grad[cut]
            errors.append(float(np.abs(grad[cut] - want).max() / np.abs(want).max()))
        worst = max(worst, max(errors))
        assert max(errors) < 1e-10, (case, max(errors))
        comm.barrier(world)
    if world.rank == 0:
        print("worst relative error " + repr(worst), flush=True)


def memory():
    """PP = 4, M = 8: the peak activation bytes of each schedule, with and without deallocating
    sent outputs; a deallocated output holds one element after its send."""
    from npmegatron import comm
    from npmegatron.bench.pipeline import memory_table
    from npmegatron.model import GPTConfig
    from npmegatron.pipeline import schedules

    comm.init()
    freed = []
    real = schedules.deallocate

    def watch(t):
        real(t)
        freed.append(t)

    schedules.deallocate = watch
    cfg = GPTConfig(num_layers=8, hidden_size=32, num_attention_heads=4, max_position_embeddings=32,
                    hidden_dropout=0.0, attention_dropout=0.0)
    table = memory_table(cfg, 4, 8, 4, 32)
    assert all(t.data.size == 1 for t in freed) and freed or comm.init().rank == 3
    if comm.init().rank == 0:
        print("TABLE " + repr(table), flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cases = parser.add_subparsers(dest="case", required=True)
    cases.add_parser("check").add_argument("cases", type=json.loads, help="a JSON list of cases")
    cases.add_parser("memory")
    args = parser.parse_args(argv)
    if args.case == "check":
        check(args.cases)
    else:
        memory()


if __name__ == "__main__":
    main()
