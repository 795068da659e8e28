"""Stage layouts: which layers, and whether the embedding (E) or the loss (L), each pipeline
stage holds. Megatron's --pipeline-model-parallel-layout language: `E`, `t` (a transformer
layer), `L`, `|` between stages, `x*n` and `(...)*n` repetition, commas and spaces ignored.
Stage i runs on pipeline rank i mod PP as its virtual stage i div PP."""
from dataclasses import dataclass

from .autograd import InputError


@dataclass
class StageSpec:
    index: int
    layers: list
    pre_process: bool    # holds the embedding
    post_process: bool   # holds the final LayerNorm, output layer and loss


def _expand(text, where):
    out, i = [], 0
    while i < len(text):
        c = text[i]
        if c in ", \t":
            i += 1
            continue
        if c == "(":
            depth, j = 1, i + 1
            while j < len(text) and depth:
                depth += {"(": 1, ")": -1}.get(text[j], 0)
                j += 1
            if depth:
                raise InputError(f"layout {where!r} has an unclosed '('; close every group")
            unit, i = _expand(text[i + 1:j - 1], where), j
        elif c in "EtL|":
            unit, i = [c], i + 1
        else:
            raise InputError(f"layout {where!r} has an unknown symbol {c!r}; use E, t, L, |, x*n, "
                             "(...)*n")
        if i < len(text) and text[i] == "*":
            j = i + 1
            while j < len(text) and text[j].isdigit():
                j += 1
            if j == i + 1:
                raise InputError(f"layout {where!r} has '*' without a count; write e.g. t*3")
            unit, i = unit * int(text[i + 1:j]), j
        out.extend(unit)
    return out


def parse_layout(text):
    """'Et*3|(tt|)*4,tL' -> [['E','t','t','t'], ['t','t'] x 4, ['t','L']]."""
    symbols = _expand(text, text)
    stages, current = [], []
    for s in symbols:
        if s == "|":
            stages.append(current)
            current = []
        else:
            current.append(s)
    stages.append(current)
    return stages


def plan_stages(stages, num_layers, pp, where):
    """Check a parsed layout against the model and PP size; number the layers."""
    flat = [s for stage in stages for s in stage]
    problems = []
    if flat.count("t") != num_layers:
        problems.append(f"has {flat.count('t')} transformer layers but the model has {num_layers}")
    if flat.count("E") != 1 or stages[0][:1] != ["E"]:
        problems.append("must start with the embedding E, once")
    if flat.count("L") != 1 or stages[-1][-1:] != ["L"]:
        problems.append("must end with the loss L, once")
    if any(not stage for stage in stages):
        problems.append("has an empty stage")
    if len(stages) % pp:
        problems.append(f"has {len(stages)} stages, not a multiple of the pipeline size {pp}")
    if problems:
        raise InputError(f"pipeline layout {where!r} {problems[0]}; fix the layout or the sizes")
    specs, layer = [], 0
    for i, stage in enumerate(stages):
        n = stage.count("t")
        specs.append(StageSpec(i, list(range(layer, layer + n)), "E" in stage, "L" in stage))
        layer += n
    return specs


def default_layout(num_layers, pp, virtual=1):
    """Layers split evenly over PP x virtual stages, embedding first, loss last."""
    stages = pp * virtual
    if num_layers % stages:
        raise InputError(f"{num_layers} layers do not split evenly over {pp} pipeline stages x "
                         f"{virtual} virtual stages; change num_layers or give a layout string")
    per = num_layers // stages
    text = "|".join(("E" if i == 0 else "") + "t" * per + ("L" if i == stages - 1 else "")
                    for i in range(stages))
    return text
