"""`train --config FILE` (YAML, TOML or JSON; keys are the flags' names, sections allowed), the
command line overriding the file, `--print-config`, and the resolved configuration written beside
every checkpoint: file -> run -> saved config -> the same run."""
import json
import subprocess
import sys

import pytest
import yaml

from helpers import ROOT
from npmegatron.training import TrainConfig

CLI = [sys.executable, "-m", "npmegatron.cli"]


def run(args, cwd=ROOT):
    return subprocess.run(CLI + args, cwd=cwd, capture_output=True, text=True, timeout=300)


def config_of(printed):
    """The TrainConfig a --print-config output (or a saved config.yaml) describes."""
    return TrainConfig.from_flat(**{key.replace("-", "_"): value for key, value in yaml.safe_load(printed).items()})


@pytest.mark.quick_variants(first=1)
@pytest.mark.parametrize("name, text", [
    ("run.yaml", "num-layers: 3\nhidden_size: 48\nlr: 0.001\nsequence-parallel: false\nlr-decay-style: WSD\n"
                 "lr-wsd-decay-iters: 10\n"),
    ("run.toml", "[model]\nnum-layers = 3\nhidden-size = 48\n[training]\nlr = 0.001\nlr-decay-style = 'WSD'\n"
                 "lr-wsd-decay-iters = 10\n"),
    ("run.json", json.dumps({"num-layers": 3, "hidden-size": 48, "lr": 1e-3, "lr-decay-style": "WSD",
                             "lr-wsd-decay-iters": 10})),
])
def test_a_file_sets_the_flags_and_the_command_line_overrides_it(tmp_path, name, text):
    (tmp_path / name).write_text(text)
    result = run(["train", "--config", str(tmp_path / name), "--print-config"])
    assert result.returncode == 0, result.stderr
    config = config_of(result.stdout)
    assert (config.model.num_layers, config.model.hidden_size, config.lr, config.lr_decay_style) == (3, 48, 1e-3, "WSD")
    result = run(["train", "--config", str(tmp_path / name), "--num-layers", "5", "--print-config"])
    assert config_of(result.stdout).model.num_layers == 5 and config_of(result.stdout).model.hidden_size == 48


@pytest.mark.quick_variants(first=2)
@pytest.mark.parametrize("name, text, message", [
    ("a.yaml", "num-layerz: 3\n", "--config {p}: 'num-layerz' is not a flag of `train`"),
    ("a.yaml", "num-layers: three\n", "--config {p}: 'num-layers' is 'three', 'three' is not a valid integer"),
    ("a.yaml", "num-layers: [1, 2\n", "--config {p} is not valid YAML"),
    ("a.toml", "num-layers = \n", "--config {p} is not valid TOML"),
    ("a.yaml", "- 1\n- 2\n", "--config {p} holds a list, not a mapping of flag names to values"),
    ("a.ini", "x=1\n", "--config {p}: a configuration file is YAML (.yaml, .yml), TOML (.toml) or JSON"),
    ("a.yaml", "lr-decay-style: WSD\n", "--lr-decay-style WSD needs --lr-wsd-decay-iters"),
])
def test_a_bad_file_is_one_sentence(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    result = run(["train", "--config", str(path), "--print-config"])
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode != 0 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert message.format(p=path) in lines[0], lines[0]


def test_every_checkpoint_holds_the_run_as_a_config_file_that_runs_it_again(tmp_path):
    (tmp_path / "run.yaml").write_text("num-layers: 2\nhidden-size: 32\nnum-attention-heads: 4\nseq-length: 16\n"
                                       "micro-batch-size: 2\ntrain-iters: 2\nlr-warmup-iters: 1\nsample-tokens: 0\n"
                                       "eval-iters: 1\n")
    result = run(["train", "--config", str(tmp_path / "run.yaml"), "--save", str(tmp_path / "ck")])
    assert result.returncode == 0, result.stderr
    saved = (tmp_path / "ck" / "iter_0000002" / "config.yaml").read_text()
    printed = run(["train", "--config", str(tmp_path / "run.yaml"), "--save", str(tmp_path / "ck"),
                   "--print-config"]).stdout
    assert config_of(saved) == config_of(printed)
    again = run(["train", "--config", str(tmp_path / "ck" / "iter_0000002" / "config.yaml"), "--print-config"])
    assert config_of(again.stdout) == config_of(saved)
