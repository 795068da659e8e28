"""The training step of this project's GPT in PyTorch eager (or torch.compile), to hold
`npmegatron bench step` against: npmegatron/bench/torch_peer.py, loaded by its path so that a
Python with only torch and numpy installed runs it. `python scripts/bench_torch_step.py --help`."""
import importlib.util
import os

PEER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "npmegatron", "bench", "torch_peer.py")

if __name__ == "__main__":
    spec = importlib.util.spec_from_file_location("torch_peer", PEER)
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)
    peer.main()
