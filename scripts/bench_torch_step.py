"""The reference model's training step in PyTorch eager, to hold `npmegatron bench step` against.

PyTorch is not a dependency of npmegatron: run this with a Python that has torch installed, e.g.

    python3 -m venv /tmp/torchvenv && /tmp/torchvenv/bin/pip install torch numpy
    /tmp/torchvenv/bin/python scripts/bench_torch_step.py --threads 2

and `npmegatron bench step --threads 2` right before or after it. The model is GPT-2 as
npmegatron builds it: pre-LayerNorm blocks, fused QKV, tanh GeLU, learned positions, tied output
layer, dropout 0, float32, with `scaled_dot_product_attention(is_causal=True)` and AdamW. One step
is zero_grad, forward, loss, backward and the optimizer step, as in bench step.
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
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
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
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = GPT(args.num_layers, args.hidden_size, args.num_attention_heads, args.seq_length,
                args.vocab_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, args.vocab_size, (args.micro_batch_size, args.seq_length + 1))
    inputs, targets = ids[:, :-1], ids[:, 1:]
    times = []
    for i in range(args.warmup + args.iters):
        start = time.perf_counter()
        optimizer.zero_grad()
        model(inputs, targets).backward()
        optimizer.step()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    print(json.dumps({"torch": torch.__version__, "threads": torch.get_num_threads(),
                      "step_s": statistics.median(times), "steps_s": times}))


if __name__ == "__main__":
    main()
