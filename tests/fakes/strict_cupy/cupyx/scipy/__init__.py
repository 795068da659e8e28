"""cupyx.scipy stand-in: only `special`."""
from . import special  # noqa: F401
