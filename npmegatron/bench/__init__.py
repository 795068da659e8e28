"""Benchmarks, each reporting a ratio to a ceiling measured in the same run: the training step
against the GEMM FLOP/s (step.py), collectives' bandwidth with an alpha-beta fit (comm.py),
pipeline memory per stage and overlap (pipeline.py)."""
