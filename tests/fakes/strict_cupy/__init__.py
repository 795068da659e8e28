"""The strict CuPy stand-in (cupy/, cupyx/ here) and how to put it in front of CuPy."""
from .activate import strict_cupy, strict_cupy_env, strict_cupy_path  # noqa: F401
