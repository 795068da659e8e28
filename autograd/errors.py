"""The project's one error for bad input: its message is one sentence naming the bad value and
the fix. It lives in the lowest layer so autograd, comm and npmegatron all raise the same type."""


class InputError(ValueError):
    """Bad input from a user: the message is one sentence naming the bad value and the fix."""
