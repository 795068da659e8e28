"""Configuration files: `--config FILE` in YAML, TOML or JSON, whose keys are the flags' names
(`num-layers` or `num_layers`), optionally grouped in sections as torchtitan's TOML files are
(`[model]`, `[training]`: the section names are not read). Flags given on the command line
override the file; the resolved configuration is written beside every checkpoint (config.yaml)
and printed by `--print-config`, in the same form, so a saved run is a file that runs again.
The defaults stay where they are: the config dataclasses (config.py)."""
import dataclasses
import json
import os
import tomllib

import yaml

from .autograd import InputError
from .config import GPTConfig, ParallelConfig, TrainConfig

FORMATS = {".yaml": "YAML", ".yml": "YAML", ".toml": "TOML", ".json": "JSON"}


def read(path):
    """{field name: value} of a configuration file, or one InputError sentence."""
    kind = FORMATS.get(os.path.splitext(path)[1].lower())
    if kind is None:
        raise InputError(f"--config {path}: a configuration file is YAML (.yaml, .yml), TOML (.toml) or "
                         "JSON (.json); name it with one of these extensions")
    try:
        with open(path, "rb") as f:
            text = f.read()
        content = (yaml.safe_load(text) if kind == "YAML" else tomllib.loads(text.decode("utf-8")) if kind == "TOML"
                   else json.loads(text))
    except OSError as e:
        raise InputError(f"--config {path} cannot be read ({e.strerror}); check the path") from None
    except (yaml.YAMLError, tomllib.TOMLDecodeError, ValueError, UnicodeDecodeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InputError(f"--config {path} is not valid {kind} ({first}); fix the file") from None
    return _flattened(path, content)


def _flattened(path, content):
    """The keys of the file's top level and of its sections (tables), dashes as underscores."""
    if content is None:
        return {}
    if not isinstance(content, dict):
        raise InputError(f"--config {path} holds a {type(content).__name__}, not a mapping of flag names to "
                         "values; write one `flag-name: value` per line")
    values = {}
    for key, value in content.items():
        items = value.items() if isinstance(value, dict) else [(key, value)]
        for name, item in items:
            field = str(name).replace("-", "_")
            if isinstance(item, (dict, list)) or field in values:
                what = "a section inside a section" if isinstance(item, dict) else \
                    "a list" if isinstance(item, list) else "given twice"
                raise InputError(f"--config {path}: '{name}' is {what}; give each flag once, as a single value")
            values[field] = item
    return values


#: Options a training run takes from its data, not from a flag.
FROM_THE_DATA = {"vocab_size"}


def resolved(config: TrainConfig):
    """Every flag of a training run (the model's, the layout's, the run's) by name, as the run has it."""
    flat = {}
    for section, config_class in ((config.model, GPTConfig), (config.parallel, ParallelConfig), (config, TrainConfig)):
        for spec in dataclasses.fields(config_class):
            if "help" in spec.metadata and spec.name not in FROM_THE_DATA:
                flat[spec.name.replace("_", "-")] = getattr(section, spec.name)
    return flat


def dump(config: TrainConfig):
    """resolved(config) as YAML, a file that `--config` reads back into the same run."""
    return yaml.safe_dump(resolved(config), sort_keys=False, default_flow_style=False)
