"""Context parallelism (Megatron-LM's --context-parallel-size): each sample's sequence split over
the ranks of a CP group, attention computed as ring attention."""
from .ring_attention import ring_attention
from .split import local_positions

__all__ = ["ring_attention", "local_positions"]
