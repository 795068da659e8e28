"""Machine profiles: the constants of the step-time model, as JSON.

    {
      "name": "dgx2h",                       # free text
      "description": "...",                  # optional: where the numbers come from
      "flops": 39e12,                        # achieved FLOP/s of a whole training step per device
        # or "peak_flops": 125e12 with "achieved_fraction": 0.312 (flops = their product);
        # "peak_flops" alone is a device's peak, against which plan reports utilisation
      "published": {"gemm": {"2": [[M, N, K, TFLOP/s], ...], "4": [...]},   # or, for a GPU (cuBLAS's M, N)
        "passes": {tensor: [forward, backward]}, "loss_bytes_per_logit": [f, b],     # known from
        "optimizer_bytes_per_parameter": 68,     # published figures: rates by kind of work
        "ddp_bytes_per_parameter": 12,           # optional: the DP gradients' copies once a step
        "rng_state_bytes": 824000, "host_link_bytes_per_s": 1.575e10,  # optional, all four or none:
        "host_round_trip_s": 6.7e-6, "launch_s": 3.8e-6,  # where the code waits for the host
        "sm_count": 80, "nccl_channels": 2},  # optional, both or none: an overlapped all-reduce's SMs
        # (perf/published.py; then memory_bandwidth_bytes_per_s is required and flops unused)
      "device": {"gemm": {"fp32": [[M, N, K, TFLOP/s], ...], "tf32": ..., "bf16": ..., "fp16": ...},
        "bandwidth": {"bytes": [...], "bytes_per_s": [...]}, "launch_gap_s": 1.5e-6,   # or, for
        "host_s_per_layer": {"bf16": ...}, "host_s_per_micro_batch": {...}},  # this engine on a GPU:
        # the card's measured rates (perf/device.py; `plan calibrate --device gpu`); flops unused
        # "peak_flops" may then be given by precision: {"fp32": 6.7e13, "bf16": 9.895e14, ...}
      "flops_recompute": "none",             # optional: recomputation the flops were measured with
      "devices_per_node": 16,
      "device_memory_bytes": 34359738368,
      "dp_overlap": 1.0,                     # optional: share of backward that hides DP all-reduce
      "memory_bandwidth_bytes_per_s": 9e11,  # optional: a device's memory bandwidth (the optimizer)
      "ranks_share_flops": false,            # optional: true for a CPU, whose ranks split it:
      "flops_by_threads": {"1": ..., "2": ...},  # optional: the rate per BLAS thread count
      "measured": {"threads": {"1": {...}, "2": {...}}, "sharing_factor": 1.1},  # optional: this
        # machine's rates by kind of work (`plan calibrate` on a CPU; perf/work.py): per thread
        # count "gemm" {"dims",
        # "flops" [rows][cols][inner]}, "attention" {"seqs", "head_dims", "none_forward",
        # "none_backward", "dropout_forward", "dropout_backward" [seq][head size], seconds per
        # score}, "bandwidth" {kind: {"elements", "bytes_per_s"}} ("stream" and any of work.PASSES's
        # kinds), "bandwidth_bytes_per_s", "layer_overhead_s", "micro_batch_overhead_s"; and the
        # slowdown of processes time-sliced two to a core
      "intra": {"alpha_s": 2e-6, "beta_s_per_byte": 6.67e-12},     # one pair for every collective
      "inter": {"all_reduce": {"alpha_s": ..., "beta_s_per_byte": ..., "base_s": ...},  # or one
                "all_gather": {...}, "reduce_scatter": {...}, "sendrecv": {...}}  # per collective
    }

alpha_s and beta_s_per_byte are per ring step and per byte sent by one device (the link
parameters of the ring formulas in time_model.py), not the fit of a whole collective; the
optional base_s (default 0) is a whole call's own latency, as NCCL's latency model has one.
"intra" applies to groups within one node; "inter" to groups spanning nodes, its beta being one
device's share of the node's network bandwidth (node bandwidth / devices per node).
"""
import json
import math
import os

from ..autograd import InputError

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "sendrecv")
PROFILE_DIR = os.path.join(os.path.dirname(__file__), "profiles")


def shipped_profiles():
    return sorted(f[:-5] for f in os.listdir(PROFILE_DIR) if f.endswith(".json"))


def resolve(name_or_path):
    """A file path, or the name of a shipped profile ('dgx2h')."""
    if os.path.exists(name_or_path):
        return name_or_path
    shipped = os.path.join(PROFILE_DIR, name_or_path + ".json")
    if os.path.sep not in name_or_path and os.path.exists(shipped):
        return shipped
    raise InputError(f"profile {name_or_path!r} is neither a file nor a shipped profile "
                     f"({', '.join(shipped_profiles())}); give a profile JSON file or one of those names")


def load_profile(name_or_path):
    """The profile, checked and normalised: 'flops' set, 'intra'/'inter' per collective."""
    path = resolve(name_or_path)
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise InputError(f"profile {path} is not readable JSON ({error}); fix the file or run "
                         "`npmegatron plan calibrate --output FILE`") from None
    return normalise(raw, path)


def _real(value):
    """A JSON number that a float holds finitely (not a bool, nan, infinity or a huge integer)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _number(raw, key, path, where=""):
    value = raw.get(key) if isinstance(raw, dict) else None
    if value is None:
        raise InputError(f"profile {path} lacks the key '{where}{key}'; add it (see "
                         "npmegatron/perf/profiles.py for the schema)")
    if not _real(value) or value < 0:
        raise InputError(f"profile {path} has '{where}{key}' = {value!r}; it must be a finite "
                         "non-negative number")
    return float(value)


def _links(raw, path, name):
    section = raw.get(name) if isinstance(raw, dict) else None
    if not isinstance(section, dict):
        raise InputError(f"profile {path} lacks the key {name!r} (an object with alpha_s and "
                         "beta_s_per_byte, or one such object per collective); add it")
    if "alpha_s" in section or "beta_s_per_byte" in section:
        pair = _link(section, path, f"{name}.")
        return {op: dict(pair) for op in COLLECTIVES}
    return {op: _link(section.get(op), path, f"{name}.{op}.") for op in COLLECTIVES}


def _link(raw, path, where):
    """One link's alpha_s and beta_s_per_byte, and its base_s (0 where not given)."""
    link = {k: _number(raw, k, path, where) for k in ("alpha_s", "beta_s_per_byte")}
    link["base_s"] = _number(raw, "base_s", path, where) if "base_s" in raw else 0.0
    return link


def normalise(raw, path="<profile>"):
    if not isinstance(raw, dict):
        raise InputError(f"profile {path} is not a JSON object; see npmegatron/perf/profiles.py")
    profile = dict(raw)
    profile.setdefault("name", os.path.splitext(os.path.basename(path))[0])
    if not isinstance(profile["name"], str):
        raise InputError(f"profile {path} has 'name' = {profile['name']!r}; it must be a string")
    if "device" in raw:               # a GPU's measured rates and this engine's counted work
        profile["device"] = _device(raw["device"], path)
        profile.pop("published", None)     # the device section is the one read
        profile["flops"] = None
    elif "published" in raw:          # rates by kind of work instead of one FLOP rate
        profile["published"] = _published(raw["published"], path)
        if _number(raw, "memory_bandwidth_bytes_per_s", path) == 0:
            raise InputError(f"profile {path} gives memory_bandwidth_bytes_per_s = 0; a published profile "
                             "divides its memory-bound work by it, so it must be positive")
        profile["flops"] = None
    elif "flops" in raw:
        profile["flops"] = _number(raw, "flops", path)
    elif "peak_flops" in raw:
        profile["flops"] = _number(raw, "peak_flops", path) * _number(raw, "achieved_fraction", path)
    else:
        _number(raw, "flops", path)       # names the missing key
    if profile["flops"] == 0:
        raise InputError(f"profile {path} gives a FLOP rate of 0; it must be positive")
    peaks = raw.get("peak_flops")
    if isinstance(peaks, dict):       # by precision (fp32, tf32, bf16, fp16), as a GPU's datasheet
        if not peaks or min(_number(peaks, key, path, "peak_flops.") for key in peaks) == 0:
            raise InputError(f"profile {path} has 'peak_flops' = {peaks!r}; give positive FLOP/s by precision, "
                             "e.g. {\"bf16\": 9.895e14}")
    elif "peak_flops" in raw and _number(raw, "peak_flops", path) == 0:
        raise InputError(f"profile {path} gives peak_flops = 0; it is a device's peak FLOP/s, the "
                         "denominator of model-FLOP utilisation, so it must be positive")
    profile["devices_per_node"] = _count(raw, "devices_per_node", path)
    profile["device_memory_bytes"] = _number(raw, "device_memory_bytes", path)
    profile["dp_overlap"] = _number(raw, "dp_overlap", path) if "dp_overlap" in raw else 1.0
    if profile["dp_overlap"] > 1:
        raise InputError(f"profile {path} has 'dp_overlap' = {raw['dp_overlap']!r}; it is a share of "
                         "backward, from 0 to 1")
    if "memory_bandwidth_bytes_per_s" in raw:
        profile["memory_bandwidth_bytes_per_s"] = _number(raw, "memory_bandwidth_bytes_per_s", path)
    profile["flops_recompute"] = raw.get("flops_recompute", "none")
    if profile["flops_recompute"] not in ("none", "selective", "full"):
        raise InputError(f"profile {path} has flops_recompute {profile['flops_recompute']!r}; use none, "
                         "selective or full")
    profile["ranks_share_flops"] = raw.get("ranks_share_flops", False)
    if not isinstance(profile["ranks_share_flops"], bool):
        raise InputError(f"profile {path} has 'ranks_share_flops' = {raw['ranks_share_flops']!r}; it "
                         "must be true or false")
    if "flops_by_threads" in raw:
        profile["flops_by_threads"] = _rates_by_threads(raw["flops_by_threads"], path)
    if "measured" in raw:
        profile["measured"] = _measured(raw["measured"], path)
    profile["intra"] = _links(raw, path, "intra")
    profile["inter"] = _links(raw, path, "inter")
    return profile


def _count(raw, key, path):
    """A whole number of at least 1 (devices, threads), given as a JSON number."""
    value = _number(raw, key, path)
    if value != int(value) or not 1 <= value <= 2 ** 20:
        raise InputError(f"profile {path} has '{key}' = {raw[key]!r}; it must be a whole number "
                         "from 1 to 1048576")
    return int(value)


def _rates_by_threads(rates, path):
    """{"threads": FLOP/s}, checked: every count a positive integer, every rate positive."""
    if not isinstance(rates, dict) or not rates:
        raise InputError(f"profile {path} has 'flops_by_threads' = {rates!r}; it must be an object "
                         "like {\"1\": 5e10, \"2\": 9e10}")
    out = {}
    for threads, rate in rates.items():
        if not (threads.isascii() and threads.isdigit() and 1 <= int(threads) <= 2 ** 20):
            raise InputError(f"profile {path} has flops_by_threads key {threads!r}; keys are thread "
                             "counts, positive integers")
        out[threads] = _number(rates, threads, path, "flops_by_threads.")
        if out[threads] <= 0:
            raise InputError(f"profile {path} gives flops_by_threads.{threads} = 0; it must be positive")
    return out


ATTENTION_TABLES = ("none_forward", "none_backward", "dropout_forward", "dropout_backward")


def _measured(raw, path):
    """The "measured" section, checked: every thread count's tables the shape of their axes,
    every rate positive (perf/work.py divides by them)."""
    where = "measured.threads"
    threads = raw.get("threads") if isinstance(raw, dict) else None
    if not isinstance(threads, dict) or not threads:
        raise InputError(f"profile {path} has no '{where}' object of thread counts; run "
                         "`npmegatron plan calibrate --output FILE` again")
    if "sharing_factor" in raw and _number(raw, "sharing_factor", path, "measured.") < 1:
        raise InputError(f"profile {path} has 'measured.sharing_factor' = {raw['sharing_factor']!r}; it is a "
                         "slowdown, 1 or more")
    for count, entry in threads.items():
        if not (count.isascii() and count.isdigit() and 1 <= int(count) <= 2 ** 20):
            raise InputError(f"profile {path} has {where} key {count!r}; keys are thread counts, positive integers")
        at = f"{where}.{count}."
        if not isinstance(entry, dict):
            raise InputError(f"profile {path} has '{at[:-1]}' = {entry!r}; it must be an object")
        gemm, attention = entry.get("gemm"), entry.get("attention")
        dims = _axis(gemm, "dims", path, at + "gemm.")
        _grid(gemm.get("flops"), [len(dims)] * 3, path, at + "gemm.flops")
        axes = [len(_axis(attention, key, path, at + "attention.")) for key in ("seqs", "head_dims")]
        for key in ATTENTION_TABLES:
            _grid(attention.get(key), axes, path, f"{at}attention.{key}")
        tables = entry.get("bandwidth")
        if not isinstance(tables, dict) or "stream" not in tables:
            raise InputError(f"profile {path} lacks '{at}bandwidth.stream'; run `npmegatron plan calibrate` again")
        for kind, table in tables.items():
            _grid(table.get("bytes_per_s") if isinstance(table, dict) else None,
                  [len(_axis(table, "elements", path, f"{at}bandwidth.{kind}."))], path,
                  f"{at}bandwidth.{kind}.bytes_per_s")
        if _number(entry, "bandwidth_bytes_per_s", path, at) <= 0:
            raise InputError(f"profile {path} gives {at}bandwidth_bytes_per_s = 0; it must be positive")
        _number(entry, "layer_overhead_s", path, at)
        _number(entry, "micro_batch_overhead_s", path, at)
    return raw


def _check_object(raw, path, section):
    if not isinstance(raw, dict):
        raise InputError(f"profile {path} has '{section}' = {raw!r}; it must be an object (see "
                         "npmegatron/perf/profiles.py)")


PASS_TABLES = ("hidden", "qkv", "context", "ffn", "scores", "dropout", "embedding", "norm")


def _published(raw, path):
    """The "published" section, checked: a GEMM point list per element width, [forward, backward]
    passes for every tensor perf/published.py counts, the loss's and the optimizer's bytes."""
    where = "published."
    _check_object(raw, path, "published")
    gemm = raw.get("gemm")
    if not isinstance(gemm, dict) or not gemm:
        raise InputError(f"profile {path} lacks '{where}gemm', an object of [rows, cols, inner, TFLOP/s] "
                         "lists keyed by element bytes (\"2\", \"4\"); add it")
    for width, points in gemm.items():
        if width not in ("2", "4") or not isinstance(points, list) or not points:
            raise InputError(f"profile {path} has {where}gemm.{width} = {points!r}; give element bytes \"2\" or "
                             "\"4\" each a non-empty list of [rows, cols, inner, TFLOP/s]")
        for point in points:
            if not (isinstance(point, list) and len(point) == 4 and all(_real(v) and v > 0 for v in point)):
                raise InputError(f"profile {path} has {where}gemm.{width} entry {point!r}; each is "
                                 "[M, N, K, TFLOP/s], four positive finite numbers")
    passes = raw.get("passes")
    for name in PASS_TABLES:
        pair = passes.get(name) if isinstance(passes, dict) else None
        if not (isinstance(pair, list) and len(pair) == 2):
            raise InputError(f"profile {path} lacks '{where}passes.{name}' as [forward, backward] passes; add it")
        for value in pair:
            if not _real(value) or value < 0:
                raise InputError(f"profile {path} has {where}passes.{name} = {pair!r}; passes are finite "
                                 "non-negative numbers")
    loss = raw.get("loss_bytes_per_logit")
    if not (isinstance(loss, list) and len(loss) == 2):
        raise InputError(f"profile {path} lacks '{where}loss_bytes_per_logit' as [forward, backward]; add it")
    _grid(loss, [2], path, f"{where}loss_bytes_per_logit")
    if _number(raw, "optimizer_bytes_per_parameter", path, where) <= 0:
        raise InputError(f"profile {path} gives {where}optimizer_bytes_per_parameter = 0; it must be positive")
    if "ddp_bytes_per_parameter" in raw:
        _number(raw, "ddp_bytes_per_parameter", path, where)
    given = [key for key in HOST_KEYS if key in raw]
    if given and len(given) < len(HOST_KEYS):
        raise InputError(f"profile {path} gives {where}{given[0]} but not all of {', '.join(HOST_KEYS)}; give the "
                         "host's four figures together or none (perf/published.py)")
    if given and {key: _number(raw, key, path, where) for key in HOST_KEYS}["host_link_bytes_per_s"] == 0:
        raise InputError(f"profile {path} gives {where}host_link_bytes_per_s = 0; the state copies divide by it, "
                         "so it must be positive")
    _sm_figures(raw, path, where)
    return raw


def _sm_figures(raw, path, where):
    """The optional SM figures of an overlapped all-reduce (perf/published.py): both or neither,
    whole numbers, and fewer channels than SMs."""
    given = [key for key in ("sm_count", "nccl_channels") if key in raw]
    if not given:
        return
    if len(given) == 1:
        raise InputError(f"profile {path} gives {where}{given[0]} without the other of sm_count and nccl_channels; "
                         "give both or neither (perf/published.py: overlap_contention_seconds)")
    sms, channels = raw["sm_count"], raw["nccl_channels"]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (sms, channels)) or not 0 <= channels < sms:
        raise InputError(f"profile {path} has {where}sm_count = {sms!r} and {where}nccl_channels = {channels!r}; "
                         "give whole numbers with 0 <= nccl_channels < sm_count")


#: A published profile's optional host figures (perf/published.py: host_seconds, optimizer_round_trips).
HOST_KEYS = ("rng_state_bytes", "host_link_bytes_per_s", "host_round_trip_s", "launch_s")


GPU_PRECISIONS = ("fp32", "tf32", "bf16", "fp16")


def _device(raw, path):
    """The "device" section, checked: GEMM points by precision, a copy's bandwidth by array bytes
    and the launch gap, all positive where perf/device.py divides by them; the host's seconds a
    layer and a micro-batch optional."""
    where = "device."
    _check_object(raw, path, "device")
    gemm = raw.get("gemm")
    if not isinstance(gemm, dict) or not gemm:
        raise InputError(f"profile {path} lacks '{where}gemm', an object of [M, N, K, TFLOP/s] lists keyed by "
                         f"precision ({', '.join(GPU_PRECISIONS)}); run `npmegatron plan calibrate --device gpu`")
    for precision, points in gemm.items():
        if precision not in GPU_PRECISIONS or not isinstance(points, list) or not points or not all(
                isinstance(p, list) and len(p) == 4 and all(_real(v) and v > 0 for v in p) for p in points):
            raise InputError(f"profile {path} has {where}gemm.{precision} = {points!r}; give precisions "
                             f"{', '.join(GPU_PRECISIONS)} each a non-empty list of [M, N, K, TFLOP/s], positive")
    table = raw.get("bandwidth")
    _grid(table.get("bytes_per_s") if isinstance(table, dict) else None,
          [len(_axis(table, "bytes", path, where + "bandwidth."))], path, where + "bandwidth.bytes_per_s")
    _number(raw, "launch_gap_s", path, where)
    for key in ("host_s_per_layer", "host_s_per_micro_batch"):        # optional: once or by precision
        value = raw.get(key)
        if isinstance(value, dict):
            for precision in value:
                _number(value, precision, path, f"{where}{key}.")
        elif key in raw:
            _number(raw, key, path, where)
    return raw


def _axis(section, key, path, where):
    """A grid axis: increasing positive numbers."""
    values = section.get(key) if isinstance(section, dict) else None
    if not (isinstance(values, list) and values and all(
            _real(v) and v > 0 for v in values)
            and values == sorted(set(values))):
        raise InputError(f"profile {path} has '{where}{key}' = {values!r}; it must be a list of increasing "
                         "positive numbers (run `npmegatron plan calibrate` again)")
    return values


def _grid(values, lengths, path, where):
    """Nested lists of the given lengths whose leaves are positive finite numbers."""
    if not lengths:
        if not _real(values) or values <= 0:
            raise InputError(f"profile {path} has a value {values!r} in '{where}'; every entry must be a "
                             "positive finite number")
        return
    if not isinstance(values, list) or len(values) != lengths[0]:
        raise InputError(f"profile {path} has '{where}' not shaped as its axes ({' x '.join(map(str, lengths))}); "
                         "run `npmegatron plan calibrate` again")
    for value in values:
        _grid(value, lengths[1:], path, where)
