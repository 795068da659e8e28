"""The reference model's training step in PyTorch eager, to hold `npmegatron bench step` against.

PyTorch is not a dependency of npmegatron: run this with a Python that has torch installed, e.g.

    python3 -m venv /tmp/torchvenv && /tmp/torchvenv/bin/pip install torch numpy
    /tmp/torchvenv/bin/python scripts/bench_torch_step.py --threads 2

and `npmegatron bench step --threads 2` right before or after it. The model is GPT-2 as
npmegatron builds it: pre-LayerNorm blocks, fused QKV, tanh GeLU, learned positions, tied output
layer, dropout 0, with `scaled_dot_product_attention(is_causal=True)` and AdamW. One step is
zero_grad, forward, loss, backward and the optimizer step, as in bench step.

On a GPU (`--device cuda`) the optimizer is fused AdamW, `--precision tf32` lets float32 matmuls
use TF32 and `--precision bf16` runs forward under bfloat16 autocast with float32 parameters (as
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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("num-layers", 4), ("hidden-size", 512), ("num-attention-heads", 8),
                          ("seq-length", 256), ("micro-batch-size", 8), ("vocab-size", 256),
                          ("threads", 2), ("warmup", 2), ("iters", 5)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--precision", choices=["fp32", "tf32", "bf16"], default="fp32")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.backends.cuda.matmul.allow_tf32 = args.precision == "tf32"
    torch.manual_seed(0)
    model = GPT(args.num_layers, args.hidden_size, args.num_attention_heads, args.seq_length,
                args.vocab_size).to(args.device)
    cuda = args.device == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    step_model = torch.compile(model) if args.compile else model
    ids = torch.randint(0, args.vocab_size, (args.micro_batch_size, args.seq_length + 1), device=args.device)
    inputs, targets = ids[:, :-1], ids[:, 1:]
    times = []
    for i in range(args.warmup + args.iters):
        start = time.perf_counter()
        optimizer.zero_grad()
        with torch.autocast(args.device, torch.bfloat16, enabled=args.precision == "bf16"):
            loss = step_model(inputs, targets)
        loss.backward()
        optimizer.step()
        if cuda:
            torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    print(json.dumps({"torch": torch.__version__, "device": torch.cuda.get_device_name() if cuda else "cpu",
                      "precision": args.precision, "compile": args.compile, "threads": torch.get_num_threads(),
                      "step_s": step_s, "tokens_per_s": args.micro_batch_size * args.seq_length / step_s,
                      "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None, "steps_s": times}))


if __name__ == "__main__":
    main()
