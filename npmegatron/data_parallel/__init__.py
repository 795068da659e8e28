"""Data parallelism: replicas of the model on different samples, their gradients averaged over
the data-parallel group by bucketed all-reduces that overlap backward (buckets.py)."""
from .buckets import GradientBuckets

__all__ = ["GradientBuckets"]
