"""Train GPT-2 with npmegatron: `python scripts/train.py --help` (the same as `npmegatron train`)."""
from npmegatron.cli import train

if __name__ == "__main__":
    train(prog_name="train.py")
