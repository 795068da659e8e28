"""cupy.random stand-in: NumPy's generators behind CuPy's API, results as cupy arrays.

CuPy facts kept (cupy/random/__init__.py, _generator.py, _generator_api.pyx): RandomState has
`seed()` but no get_state/set_state; `default_rng(seed)` gives a Generator over an XORWOW bit
generator whose state cannot be read or saved (no `state` attribute anywhere); float methods take
`dtype`. The numbers differ from CuPy's (cuRAND), as they do between any two generators."""
import numpy

from .._core import ndarray, wrap, wrap_result, check_device

_FLOAT_METHODS = ("beta", "chisquare", "exponential", "f", "gamma", "gumbel", "laplace",
                  "logistic", "lognormal", "normal", "pareto", "power", "rayleigh",
                  "standard_cauchy", "standard_exponential", "standard_gamma",
                  "standard_normal", "standard_t", "triangular", "uniform", "vonmises", "wald",
                  "weibull", "random_sample")


def _as_host(x):
    """Distribution parameters: cupy arrays are read directly (no sync: the real kernel reads
    them on the device)."""
    if isinstance(x, ndarray):
        check_device(x)
        return x._a
    if isinstance(x, numpy.ndarray) and x.ndim:
        raise TypeError("a NumPy array as a cupy.random parameter: pass a cupy array")
    return x


def _float_method(name):
    def method(self, *args, dtype=float, **kwargs):
        args = [_as_host(a) for a in args]
        kwargs = {k: _as_host(v) for k, v in kwargs.items()}
        result = getattr(self._rs, name)(*args, **kwargs)
        return wrap(numpy.asarray(result, dtype=dtype))
    method.__name__ = name
    return method


class RandomState:
    """cupy.random.RandomState(seed): no get_state/set_state (CuPy has none)."""

    def __init__(self, seed=None, method=None):
        self._rs = numpy.random.RandomState(seed)

    def seed(self, seed=None):
        self._rs.seed(seed)

    def rand(self, *size, dtype=float):
        return wrap(numpy.asarray(self._rs.random_sample(size), dtype=dtype))

    def randn(self, *size, dtype=float):
        return wrap(numpy.asarray(self._rs.standard_normal(size), dtype=dtype))

    def randint(self, low, high=None, size=None, dtype=int):
        return wrap(numpy.asarray(self._rs.randint(low, high, size, dtype=dtype)))

    def random_integers(self, low, high=None, size=None):
        return self.randint(low, (low if high is None else high) + 1, size)

    def binomial(self, n, p, size=None, dtype=int):
        return wrap(numpy.asarray(self._rs.binomial(_as_host(n), _as_host(p), size), dtype=dtype))

    def poisson(self, lam=1.0, size=None, dtype="l"):
        return wrap(numpy.asarray(self._rs.poisson(_as_host(lam), size), dtype=dtype))

    def choice(self, a, size=None, replace=True, p=None):
        return wrap_result(self._rs.choice(_as_host(a), size, replace, _as_host(p)))

    def shuffle(self, a):
        if not isinstance(a, ndarray):
            raise TypeError("The array must be cupy.ndarray")
        check_device(a)
        self._rs.shuffle(a._a)

    def permutation(self, a):
        return wrap_result(self._rs.permutation(_as_host(a)))


for _name in _FLOAT_METHODS:
    setattr(RandomState, _name, _float_method(_name))
RandomState.random = RandomState.random_sample

_state = RandomState()


def get_random_state():
    return _state


def set_random_state(rs):
    global _state
    _state = rs


def seed(seed=None):
    _state.seed(seed)


def reset_states():
    global _state
    _state = RandomState()


def _module_function(name):
    def fn(*args, **kwargs):
        return getattr(_state, name)(*args, **kwargs)
    fn.__name__ = name
    return fn


for _name in (*_FLOAT_METHODS, "rand", "randn", "randint", "random_integers", "binomial",
              "poisson", "choice", "shuffle", "permutation"):
    globals()[_name] = _module_function(_name)
random = sample = ranf = _module_function("random_sample")


# --- the Generator API ---------------------------------------------------------------------

class BitGenerator:
    """Base of CuPy's bit generators; its state is device memory, not a Python value."""


class XORWOW(BitGenerator):
    """cupy.random.XORWOW(seed): no `state`, no `random_raw` (nothing to save or restore)."""

    def __init__(self, seed=None, *, size=-1):
        self._seed_seq = numpy.random.SeedSequence(seed)


class Generator:
    """cupy.random.Generator(bit_generator): NumPy's PCG64 underneath, seeded from the bit
    generator's seed sequence; the attributes that would expose its state do not exist."""

    def __init__(self, bit_generator):
        self.bit_generator = bit_generator
        self._g = numpy.random.Generator(numpy.random.PCG64(bit_generator._seed_seq))

    def _out(self, values, dtype, out):
        if out is not None:
            check_device(out)
            out._a[...] = values
            return out
        return wrap(numpy.asarray(values, dtype=dtype))

    def random(self, size=None, dtype=numpy.float64, out=None):
        return self._out(self._g.random(size if out is None else out.shape, dtype=dtype), dtype, out)

    def standard_normal(self, size=None, dtype=numpy.float64, out=None):
        shape = size if out is None else out.shape
        return self._out(self._g.standard_normal(shape, dtype=dtype), dtype, out)

    def uniform(self, low=0.0, high=1.0, size=None, dtype=numpy.float64):
        return wrap(numpy.asarray(self._g.uniform(_as_host(low), _as_host(high), size), dtype=dtype))

    def normal(self, loc=0.0, scale=1.0, size=None, dtype=numpy.float64):
        return wrap(numpy.asarray(self._g.normal(_as_host(loc), _as_host(scale), size), dtype=dtype))

    def integers(self, low, high=None, size=None, dtype=numpy.int64, endpoint=False):
        return wrap(numpy.asarray(self._g.integers(low, high, size, dtype=dtype, endpoint=endpoint)))

    def exponential(self, scale=1.0, size=None):
        return wrap(numpy.asarray(self._g.exponential(_as_host(scale), size)))

    def permutation(self, x):
        return wrap_result(self._g.permutation(_as_host(x)))


def default_rng(seed=None):
    if isinstance(seed, BitGenerator):
        return Generator(seed)
    if isinstance(seed, Generator):
        return seed
    return Generator(XORWOW(seed))
