"""config.json's values as input (issue 26), the checks GPT-2's and Llama's fields share: sizes are
positive integers that divide where the model needs it, real numbers are finite and in the range
HF's modules accept. Each fault is one sentence naming the field and its value.
"""
import math

from ..autograd import InputError
from ..safetensors_header import shown as _shown

LARGEST_SIZE = 2 ** 48   # no real size comes near it; larger ints overflow float checks downstream
RATE = (lambda x: 0.0 <= x < 1.0, "a number in [0, 1)")
POSITIVE = (lambda x: x > 0.0, "a positive finite number")
NOT_NEGATIVE = (lambda x: x >= 0.0, "a finite number, not negative")


def check_sizes(sizes, may_be_null=None):
    """Each size a positive integer (a JSON true, 2.0 or a string is not), or null where allowed."""
    for key, value in sizes.items():
        if not (type(value) is int and 1 <= value <= LARGEST_SIZE) and not (key == may_be_null and value is None):
            raise InputError(f"config.json has {key} {_shown(value)}; it must be a positive integer "
                             "(at most 2^48)")


def check_divides(sizes, part, whole):
    if sizes[whole] % sizes[part]:
        raise InputError(f"config.json has {part} {sizes[part]}, which does not divide {whole} "
                         f"{sizes[whole]}; give the config.json saved with these weights")


def config_numbers(get, rules):
    """config.json's real-valued fields ({field: (test, rule)}) as floats, each in the range HF's
    modules accept (a dropout rate in [0, 1)): a string, a boolean, NaN or infinity is refused
    here rather than met inside the model."""
    numbers = {}
    for key, (holds, rule) in rules.items():
        number = finite(get(key))
        if number is None or not holds(number):
            raise InputError(f"config.json has {key} {_shown(get(key))}; it must be {rule}")
        numbers[key] = number
    return numbers


def finite(value):
    """A JSON number as a finite float, else None (strings, booleans, NaN, infinity, huge ints)."""
    if type(value) not in (int, float):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None
