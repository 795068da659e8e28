"""This project's GPT in PyTorch, the peer `npmegatron bench step` holds itself against: GPT-2 as
npmegatron builds it (pre-LayerNorm blocks, fused QKV, tanh GeLU, learned positions, tied output
layer, dropout 0) with `scaled_dot_product_attention(is_causal=True)` and AdamW; one step is
zero_grad, forward, loss, backward and the optimizer step, as in bench step.

PyTorch is not a dependency of npmegatron: bench step runs this when torch imports (a GPU machine
usually has it), and `scripts/bench_torch_step.py` runs it alone with any Python that has torch
(it loads this file by its path, so npmegatron need not be installed there):

    python3 -m venv /tmp/torchvenv && /tmp/torchvenv/bin/pip install torch numpy
    /tmp/torchvenv/bin/python scripts/bench_torch_step.py --threads 2

On a GPU (`--device cuda`) the optimizer is fused AdamW, `--precision tf32` lets float32 matmuls
use TF32 and `--precision bf16` / `fp16` runs forward under autocast with float32 parameters (as
`npmegatron ... --bf16` keeps an FP32 master); `--compile` adds torch.compile.
"""
import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.attn_proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.fc, self.mlp_proj = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        b, t, h = x.shape
        q, k, v = self.qkv(self.ln_1(x)).view(b, t, self.heads, 3, h // self.heads).unbind(3)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True)
        x = x + self.attn_proj(y.transpose(1, 2).reshape(b, t, h))
        return x + self.mlp_proj(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, layers, hidden, heads, seq, vocab):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, hidden), nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)

    def forward(self, ids, targets):
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.T
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def torch_step(num_layers, hidden_size, num_attention_heads, seq_length, micro_batch_size, vocab_size,
               device="cpu", precision="fp32", compile=False, threads=None, warmup=2, iters=5,
               flush_denormal=False):
    """{"step_s", "tokens_per_s", "peak_bytes", ...} of the training step in PyTorch.
    flush_denormal: denormal numbers flushed to zero (torch.set_flush_denormal); the step trains
    one batch again and again, and on the CPU PyTorch's kernels slow down several-fold once its
    values underflow into denormals."""
    if threads:
        torch.set_num_threads(threads)
    torch.set_flush_denormal(flush_denormal)
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    torch.manual_seed(0)
    cuda = device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    model = GPT(num_layers, hidden_size, num_attention_heads, seq_length, vocab_size).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    step_model = torch.compile(model) if compile else model
    ids = torch.randint(0, vocab_size, (micro_batch_size, seq_length + 1), device=device)
    inputs, targets = ids[:, :-1], ids[:, 1:]
    autocast = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    times = []
    for i in range(warmup + iters):
        start = time.perf_counter()
        optimizer.zero_grad()
        with torch.autocast(device, autocast or torch.bfloat16, enabled=autocast is not None):
            loss = step_model(inputs, targets)
        loss.backward()
        optimizer.step()
        if cuda:
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    return {"torch": torch.__version__, "device": torch.cuda.get_device_name() if cuda else "cpu",
            "precision": precision, "compile": compile, "threads": torch.get_num_threads(),
            "step_s": step_s, "tokens_per_s": micro_batch_size * seq_length / step_s,
            "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None, "steps_s": times}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("num-layers", 4), ("hidden-size", 512), ("num-attention-heads", 8),
                          ("seq-length", 256), ("micro-batch-size", 8), ("vocab-size", 256),
                          ("threads", 2), ("warmup", 2), ("iters", 5)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--precision", choices=["fp32", "tf32", "bf16", "fp16"], default="fp32")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--flush-denormal", action="store_true",
                        help="flush denormal numbers to zero (torch.set_flush_denormal), as a long CPU run should")
    args = vars(parser.parse_args())
    print(json.dumps(torch_step(**args)))


if __name__ == "__main__":
    main()
