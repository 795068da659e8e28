"""What every `npmegatron` command shares: its options generated from the configuration
dataclasses (config.py), bad input as one sentence printed once (under mpirun too), and the
relaunch under mpiexec that the benchmarks use."""
import functools
import re
import subprocess
import sys
import typing
from dataclasses import fields

import click

from . import comm, config_file
from .autograd import InputError
from .config import MODEL_PRESETS, field_default
from .perf.fit import out_of_memory


def config_options(config_class, only=None, skip=(), defaults=None):
    """click options for the fields of `config_class` made with config.option (a field's name
    with dashes is its flag), in field order; `defaults` overrides where a command differs."""
    decorators = [click_option(spec, (defaults or {}).get(spec.name, field_default(config_class, spec.name)))
                  for spec in fields(config_class) if "help" in spec.metadata
                  and spec.name not in skip and (only is None or spec.name in only)]
    return lambda command: functools.reduce(lambda f, option: option(f), reversed(decorators), command)


def model_preset_option(command):
    """--model: a named model's shape (config.MODEL_PRESETS) in place of its five flags."""
    return click.option("--model", "preset", type=click.Choice(sorted(MODEL_PRESETS)), default=None,
                        help="A model's shape (layers, hidden size, heads, sequence, vocabulary: GPT-2 124M "
                             "or 350M) in place of those five flags.")(command)


def with_model_preset(preset, options):
    """`options` (a command's, by field name) with --model's shape, refusing a flag it would override."""
    if preset is None:
        return options
    ctx = click.get_current_context()
    given = [name for name in MODEL_PRESETS[preset]
             if ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE]
    if given:
        raise InputError(f"--model {preset} sets {', '.join('--' + n.replace('_', '-') for n in given)}; "
                         "give either the preset or those flags")
    return {**options, **MODEL_PRESETS[preset]}


def click_option(spec, default):
    meta, flag = spec.metadata, "--" + spec.name.replace("_", "-")
    kind = next((t for t in typing.get_args(spec.type) if t is not type(None)), spec.type)
    shown = default is not None
    if kind is bool:
        names = [f"{flag}/--no-{flag[2:]}"] if meta["negatable"] else [flag]
        return click.option(*names, spec.name, is_flag=True, default=default,
                            show_default=meta["negatable"], help=meta["help"])
    choice = click.Choice(meta["choices"]) if meta["choices"] else kind
    return click.option(flag, *meta["aliases"], spec.name, type=choice, default=default,
                        show_default=shown, help=meta["help"])


def with_config_file(path, options):
    """`options` (a command's, by field name) with a --config file's values (config_file.read) where
    the flag was not given on the command line, each converted as its flag's value would be."""
    if path is None:
        return options
    ctx = click.get_current_context()
    params = {p.name: p for p in ctx.command.params}
    merged = dict(options)
    for name, value in config_file.read(path).items():
        if name not in options:
            raise InputError(f"--config {path}: '{name.replace('_', '-')}' is not a flag of `{ctx.command.name}`; "
                             f"see `npmegatron {ctx.command.name} --help` for their names")
        if ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE:
            continue            # the command line overrides the file
        try:
            merged[name] = None if value is None else params[name].type_cast_value(ctx, value)
        except click.BadParameter as e:
            raise InputError(f"--config {path}: '{name.replace('_', '-')}' is {value!r}, {e.message}") from None
    return merged


def user_errors(command):
    """Bad input, and an allocation that fails (the model does not fit), end the command with one
    sentence and a non-zero exit, no traceback. Under mpirun it is printed once: by rank 0 when
    every rank hit it (then all exit normally), else by the rank that hit it, which aborts the job."""
    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except (InputError, MemoryError) as error:
            if isinstance(error, MemoryError):
                error = InputError(out_of_memory(error))
            error = InputError(in_flag_names(str(error)))
            if comm.launch_size() > 1 and not comm.reports_input_error(error):
                sys.exit(1)
            raise click.ClickException(str(error)) from None
    return wrapper


def in_flag_names(message):
    """The library names parameters (`num_micro_batches`); a user of this command reads its
    flags (`--num-micro-batches`). Parameters the command has no flag for stay as they are."""
    context = click.get_current_context(silent=True)
    for param in context.command.params if context else ():
        if not isinstance(param, click.Option):
            continue
        flag = max(param.opts, key=len)
        if "_" in param.name:          # unmistakably a parameter wherever it appears
            message = re.sub(rf"(?<![-\w]){param.name}(?!\w)", flag, message)
        elif message.startswith(f"{param.name} is "):      # a one-word one only as the subject
            message = flag + message[len(param.name):]
    return message


class OneRankUsageErrors:
    """Every rank parses the same command line, so under mpirun rank 0 alone prints a usage
    error (an unknown flag, a bad value) and the other ranks exit with the same status quietly."""

    def parse_args(self, ctx, args):
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as error:
            if comm.launch_rank() != 0:
                raise click.exceptions.Exit(error.exit_code) from None
            raise


class Command(OneRankUsageErrors, click.Command):
    pass


class Group(OneRankUsageErrors, click.Group):
    command_class = Command


Group.group_class = Group


def relaunch_under_mpiexec(ranks):
    """Run this same command line on `ranks` ranks with the environment's mpiexec."""
    command = [comm.mpiexec_path(), "-n", str(ranks), sys.executable, "-m", "npmegatron.cli"] + sys.argv[1:]
    return subprocess.call(command)
