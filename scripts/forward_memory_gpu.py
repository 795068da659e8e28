"""Device memory one forward of GPT-2 124M leaves allocated for backward on a GPU, in float32 and
under --bf16: CuPy's memory pool before and after `model(ids, targets)`, the logits dropped unless
a Function keeps them. Needs a GPU (and CuPy); the strict stand-in counts the same bytes on the
CPU (scripts/count_gpu_work.py, "bytes kept for backward").

    python3 scripts/forward_memory_gpu.py [--micro-batch-size 8]
"""
import argparse

import cupy
import numpy

from npmegatron.config import GPTConfig, TrainConfig
from npmegatron.run import assemble


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batch-size", type=int, default=8)
    batch = parser.parse_args().micro_batch_size
    pool = cupy.get_default_memory_pool()
    for flags in ({}, {"bf16": True}):
        cfg = GPTConfig(num_layers=12, hidden_size=768, num_attention_heads=12, vocab_size=50304,
                        max_position_embeddings=1024, device="gpu", **flags)
        run = assemble(TrainConfig(model=cfg, seq_length=1024, micro_batch_size=batch, lr=1e-4, min_lr=0.0),
                       world_size=1)
        ids = numpy.random.default_rng(0).integers(0, cfg.vocab_size, (batch, 1025))
        for _ in range(2):          # the second forward: the pool holds what the first freed
            cupy.cuda.Device().synchronize()
            before = pool.used_bytes()
            loss = run.model.chunks[0](ids[:, :-1], ids[:, 1:])[1]
            cupy.cuda.Device().synchronize()
            after = pool.used_bytes()
            del loss
        print(f"{'--bf16' if flags else 'float32'}: kept after forward {(after - before) / 2**20:.1f} MiB; "
              f"parameters, gradients and optimizer state {before / 2**20:.1f} MiB", flush=True)
        del run
        pool.free_all_blocks()


if __name__ == "__main__":
    main()
