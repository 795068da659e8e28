"""nvmath.linalg stand-in: `advanced` only."""
