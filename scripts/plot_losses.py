"""Plot training and validation loss curves from --log-file JSON lines, one curve per run.

    python scripts/plot_losses.py OUT.png fp32=fp32.jsonl fp16=fp16.jsonl bf16=bf16.jsonl

Used for the README's mixed-precision figure (scripts/results/precision_losses.png).
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)


def read(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main(out, runs):
    figure, (train, valid) = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for label, path in runs:
        records = read(path)
        train.plot([r["iteration"] for r in records], [r["loss"] for r in records], label=label)
        evaluated = [r for r in records if "val_loss" in r]
        valid.plot([r["iteration"] for r in evaluated], [r["val_loss"] for r in evaluated], marker="o", label=label)
    for axes, title in ((train, "training loss (mean over each log interval)"), (valid, "validation loss")):
        axes.set_title(title)
        axes.set_xlabel("iteration")
        axes.grid(alpha=0.3)
        axes.legend()
    train.set_ylabel("nats per byte")
    figure.tight_layout()
    figure.savefig(out, dpi=110)


if __name__ == "__main__":
    if len(sys.argv) < 3 or any("=" not in a for a in sys.argv[2:]):
        sys.exit("usage: python scripts/plot_losses.py OUT.png LABEL=LOG.jsonl [LABEL=LOG.jsonl ...]")
    main(sys.argv[1], [tuple(a.split("=", 1)) for a in sys.argv[2:]])
