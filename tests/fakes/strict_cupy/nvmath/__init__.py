"""A strict stand-in for nvmath-python (its `linalg.advanced` stateful matrix multiplication over
cuBLASLt), over the strict CuPy stand-in's arrays: nvmath/linalg/advanced/__init__.py."""
__version__ = "1.0.0"
