"""Training against a reference written from Megatron's OptimizerParamScheduler source and from
PyTorch's AdamW and clip_grad_norm_: 30 iterations in float64 (warm-up 5 from --lr-warmup-init,
cosine decay, weight decay, clipping that binds on some steps and not on others, 2 accumulated
micro-batches), serial, TP 2, DP 2 and DP 2 with the distributed optimizer. Every logged learning
rate, loss and gradient norm, and the final parameters, agree to 1e-10.

The reference shares only the model's forward and backward (a serial GPT, itself held against
Hugging Face elsewhere) and the data's samples; the schedule, the clipping and the update are
written here again."""
import json
import math

import numpy as np
import pytest

from helpers import launch

ITERATIONS, WARMUP, LR, MIN_LR, INIT_LR, DECAY, CLIP = 30, 5, 3e-3, 3e-4, 3e-4, 0.1, 1.8
BETAS, EPS = (0.9, 0.999), 1e-8
FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "2", "--train-iters", str(ITERATIONS), "--log-interval", "1",
         "--eval-interval", "1000", "--eval-iters", "1", "--lr", str(LR), "--min-lr", str(MIN_LR),
         "--lr-warmup-iters", str(WARMUP), "--lr-warmup-init", str(INIT_LR), "--lr-decay-style", "cosine",
         "--weight-decay", str(DECAY), "--clip-grad", str(CLIP), "--adam-beta1", str(BETAS[0]),
         "--adam-beta2", str(BETAS[1]), "--adam-eps", str(EPS), "--sample-tokens", "0", "--dtype", "float64",
         "--hidden-dropout", "0", "--attention-dropout", "0"]


def megatron_lr(samples, warmup_samples, decay_samples):
    """OptimizerParamScheduler.get_lr (megatron/core/optimizer_param_scheduler.py) at num_steps =
    `samples`, cosine decay: linear warm-up from init_lr while num_steps <= warmup, min_lr past
    the decay, else the cosine of the decay's ratio."""
    if warmup_samples > 0 and samples <= warmup_samples:
        return INIT_LR + (LR - INIT_LR) * float(samples) / float(warmup_samples)
    if samples > decay_samples:
        return MIN_LR
    ratio = float(samples - warmup_samples) / float(decay_samples - warmup_samples)
    return MIN_LR + 0.5 * (math.cos(math.pi * ratio) + 1.0) * (LR - MIN_LR)


def torch_adamw_(param, grad, state, lr, step):
    """torch.optim.AdamW's update of one tensor (decoupled weight decay first), in place; Megatron
    decays matrices only (no biases, no norms)."""
    if param.ndim >= 2:
        param *= 1 - lr * DECAY
    state["m"] = BETAS[0] * state.get("m", 0.0) + (1 - BETAS[0]) * grad
    state["v"] = BETAS[1] * state.get("v", 0.0) + (1 - BETAS[1]) * grad * grad
    bias1, bias2 = 1 - BETAS[0] ** step, 1 - BETAS[1] ** step
    param -= (lr / bias1) * state["m"] / (np.sqrt(state["v"]) / math.sqrt(bias2) + EPS)


def reference(manifest_model, global_batch):
    """(per iteration (lr, loss, gradient norm), final parameters by name) of the serial model
    from the run's own configuration and seed, trained on the same samples."""
    from npmegatron import autograd as ag
    from npmegatron.checkpointing import checkpoint
    from npmegatron.data.datasets import TrainingData
    from npmegatron.model import GPT
    cfg = checkpoint.saved_config(manifest_model, sequence_parallel=False)
    model = GPT(cfg)
    sampler = TrainingData(None, None).sampler("train", 32, cfg.seed)
    params, states, records = dict(model.named_parameters()), {}, []
    for k in range(ITERATIONS):
        for p in params.values():
            p.grad = None
        ids, targets = sampler.batch(k * global_batch, global_batch)
        _, loss = model(ids, targets)
        ag.backward(loss)
        norm = math.sqrt(sum(float((p.grad ** 2).sum()) for p in params.values()))
        clip = CLIP / (norm + 1e-6)                     # torch.nn.utils.clip_grad_norm_
        lr = megatron_lr(k * global_batch, WARMUP * global_batch, ITERATIONS * global_batch)
        for name, p in params.items():
            torch_adamw_(p.data, p.grad * (clip if clip < 1 else 1.0), states.setdefault(name, {}), lr, k + 1)
        records.append((lr, float(loss.data), norm))
    return records, {name: p.data for name, p in params.items()}


@pytest.mark.parametrize("ranks,layout,global_batch", [
    (0, [], 4),
    pytest.param(2, ["--tp", "2"], 4, marks=pytest.mark.slow),
    pytest.param(2, [], 8, marks=pytest.mark.slow),
    (2, ["--use-distributed-optimizer"], 8),
], ids=["serial", "tp2", "dp2", "dp2-distopt"])
def test_schedule_clipping_and_adamw_follow_megatron_and_pytorch(tmp_path, ranks, layout, global_batch):
    from npmegatron.checkpointing import checkpoint
    from npmegatron.generation import load_for_generation
    log, ck = tmp_path / "log.jsonl", tmp_path / "ck"
    run = launch(ranks, FLAGS + layout + ["--global-batch-size", str(global_batch), "--log-file", str(log),
                                          "--save", str(ck)])
    assert run.returncode == 0, run.stdout + run.stderr
    logged = [(r["lr"], r["loss"], r["grad_norm"]) for r in map(json.loads, open(log))]
    folder, manifest = checkpoint.read_manifest(str(ck))
    expected, final = reference(manifest, global_batch)
    assert logged[0][0] == INIT_LR and logged[WARMUP][0] == LR      # the first update at init, the peak at 6
    clipped = [norm > CLIP for _, _, norm in expected]
    assert 3 <= sum(clipped) <= ITERATIONS - 3, clipped
    for got, want in zip(logged, expected):
        assert got == pytest.approx(want, rel=1e-10, abs=0), (got, want)
    model, _ = load_for_generation(folder)
    for name, p in model.named_parameters():
        rows = tuple(slice(0, n) for n in final[name].shape)     # the padded vocabulary's rows left out
        np.testing.assert_allclose(p.data[rows], final[name], rtol=1e-10, atol=1e-12, err_msg=name)
