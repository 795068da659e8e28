"""The whole training path on CuPy arrays against the same run on NumPy, in float64: run on a GPU
machine (tests/test_gpu.py) or on the CPU with the strict CuPy stand-in of tests/fakes/strict_cupy
first on PYTHONPATH (tests/test_strict_gpu.py).

    mpiexec -n N python tests/ranks/gpu_training.py TP PP FOLDER ['{"extra": "config fields"}']

Per rank: losses and gradient norms of 4 steps equal the NumPy run's to 1e-10 (or the extra's "rtol") (sequence
parallelism and dropout on), and so do the parameters after them; a run resumed from the
checkpoint of step 2 repeats steps 3 and 4 bitwise; at PP = 1 the generated text is the NumPy
run's; each rank computes on the GPU of its local rank. Under the stand-in, every host
synchronisation of a step is counted. Rank 0 prints one JSON line: {"syncs_per_step": [...], ...}."""
import json
import os
import sys

import numpy as np

from npmegatron import comm
from npmegatron.autograd.backend import to_numpy
from npmegatron.autograd.ops import fused_attention
from npmegatron.training import TrainConfig, Trainer
from npmegatron.training.trainer import PROMPT_END

LR = 1e-3


def config(device, tp, pp, **extra):
    extra = {"dtype": "float64", "attention_dropout": 0.1, **extra}
    return TrainConfig.from_flat(
        device=device, num_layers=4, hidden_size=32, num_attention_heads=4,
        seq_length=16, micro_batch_size=2, global_batch_size=8, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, sequence_parallel=tp > 1, hidden_dropout=0.1, train_iters=4, lr=LR, lr_warmup_iters=1, log_interval=100,
        eval_interval=100, eval_iters=1, sample_tokens=8, ddp_bucket_size=2000, **extra)


def strict_counters():
    """The strict stand-in's counters, or None on a real GPU."""
    import cupy
    return getattr(cupy, "_strict", None)


def run_steps(trainer, n):
    """(losses, norms, host synchronisations of each step) of n steps."""
    counters, losses, norms, syncs = strict_counters(), [], [], []
    for _ in range(n):
        before = counters.counters()["sync"] if counters and trainer.model.xp.__name__ == "cupy" else 0
        loss, norm, _ = trainer.step()
        if counters and trainer.model.xp.__name__ == "cupy":
            syncs.append(counters.counters()["sync"] - before)
        losses.append(loss)
        norms.append(norm)
    return losses, norms, syncs


def close(a, b, what, rtol=1e-10, atol=0.0):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = max(float(np.abs(b).max()), 1e-300)
    assert float(np.abs(a - b).max()) <= rtol * scale + atol, (what, a, b)


def parameters(trainer):
    return {name: to_numpy(p.data) for name, p in trainer.model.named_parameters()}


def main():
    tp, pp, folder = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    extra = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
    # float32 runs: NumPy takes the compiled CPU kernels where CuPy runs the chains, equal to
    # round-off only (and 16-bit rounding can turn that into one 16-bit step)
    rtol = extra.pop("rtol", 1e-10)
    # AdamW moves a parameter by about lr a step whatever the size of its gradient, so where the
    # gradient is round-off (the key bias's is 0 in exact arithmetic: softmax ignores a constant
    # added to a row), float32 round-off that differs between devices can send a step either way.
    # Measured on an H100 after 4 steps: parameters up to 2.2e-3 apart (bf16), 9e-4 (fp16), with
    # losses within 2.2e-5 and gradient norms within 1.2e-4. Float32 runs hold the parameters to
    # 2 lr a step; float64 runs (round-off far below AdamW's eps) to rtol.
    param_atol = 0.0 if rtol == 1e-10 else 2 * LR * 4
    world = comm.init()
    cpu = Trainer(config("cpu", tp, pp, **extra))
    cpu_losses, cpu_norms, _ = run_steps(cpu, 4)

    gpu = Trainer(config("gpu", tp, pp, save=folder, **extra))
    import cupy
    assert gpu.model.xp is cupy
    assert cupy.cuda.Device().id == comm.device_index(), "this rank computes on another rank's GPU"
    losses, norms, syncs = run_steps(gpu, 2)
    gpu.save()                                      # iter_0000002
    later = run_steps(gpu, 2)
    losses, norms, syncs = losses + later[0], norms + later[1], syncs + later[2]
    close(losses, cpu_losses, "losses", rtol)
    close(norms, cpu_norms, "gradient norms", rtol)
    mine, reference = parameters(gpu), parameters(cpu)
    for name in reference:
        close(mine[name], reference[name], name, rtol, param_atol)
    text = (gpu.sample(), cpu.sample()) if pp == 1 else (None, None)
    if rtol < 1e-6:
        assert text[0] == text[1], text
    elif pp == 1:
        # 16-bit runs agree to rounding, not bitwise: a sampled token may flip on a near-tie, so the
        # prompt is compared, and that each run generated
        prompts = [t.split(PROMPT_END)[0] for t in text]
        assert prompts[0] == prompts[1] and all(t.split(PROMPT_END)[1] for t in text), text
    gpu.close()

    resumed = Trainer(config("gpu", tp, pp, load=os.path.join(folder, "iter_0000002"), **extra))
    again, _, _ = run_steps(resumed, 2)
    assert again == losses[2:], (again, losses[2:])
    from npmegatron.comm.backends import backend_for, one_gpu_per_rank
    from npmegatron.comm.runtime import local_bus_ids
    # NCCL where each rank has a GPU of its own; ranks sharing one GPU (NCCL refuses that) use MPI.
    expected = "nccl" if one_gpu_per_rank(local_bus_ids()) else "mpi"
    assert backend_for(gpu.params[0].data).name == expected, (expected, local_bus_ids())
    fused = sorted(cupy._fusion.kernel_names) if strict_counters() else None
    attention = "fused" if fused_attention._graphs else "blockwise"     # cuDNN graphs were built
    if world.rank == 0:
        print(json.dumps({"syncs_per_step": syncs, "losses": losses, "sample": text[0], "fused": fused,
                          "attention": attention}))


if __name__ == "__main__":
    main()
