"""Rank program for tests/npmegatron/test_convert.py, test_convert_llama.py and test_convert_moe.py: a
checkpoint converted from a Hugging Face GPT-2, Llama or Qwen2-MoE folder (TP = 1, one shard) loaded
at TP = 2 x PP = 2 (4 ranks, resharded on load), one forward and backward of fixed tokens through
the pipeline schedule. Each rank writes RANK.npz into OUT: its gradients with their places in the
master tensors, and on the last stage the gathered logits and the loss.

    mpiexec -n 4 python tests/ranks/converted_gpt2.py CHECKPOINT TOKENS.npy OUT
"""
import json
import os
import sys

import numpy as np


def main(folder, tokens_path, out):
    from npmegatron.autograd.backend import to_numpy
    from npmegatron.run import build_grid, build_model
    from npmegatron.pipeline import StageExchange, run_schedule
    from npmegatron.checkpointing import checkpoint
    from npmegatron.checkpointing.reshard import places

    grid = build_grid(2, 2)
    _, manifest = checkpoint.read_manifest(folder)
    cfg = checkpoint.saved_config(manifest, hidden_dropout=0.0, attention_dropout=0.0)
    model = build_model(cfg, grid)
    checkpoint.load(folder, model, None, grid)
    tokens = np.load(tokens_path)
    logits = []
    loss = run_schedule(model, StageExchange(grid, cfg.dtype, model.xp, 1), [(tokens[:, :-1], tokens[:, 1:])],
                        "1f1b", outputs=logits)
    model.finalize_grads()      # the tied embedding's two copies summed over the pipeline ends
    # an expert no token chose has no gradient: zero
    arrays = {f"grad.{name}": np.zeros(p.data.shape) if p.grad is None else to_numpy(p.grad)
              for name, p in model.named_parameters()}
    if logits:
        arrays["logits"] = to_numpy(model.chunks[-1].full_logits(logits[0]))
        arrays["loss"] = np.asarray(to_numpy(loss))
    arrays["places"] = np.frombuffer(json.dumps(places(model)).encode(), np.uint8)
    np.savez(os.path.join(out, f"{grid.rank}.npz"), **arrays)


if __name__ == "__main__":
    main(*sys.argv[1:4])
