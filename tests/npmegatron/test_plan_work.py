"""plan's work model (npmegatron/perf/work.py): a profile with this machine's measured rates turns
a rank's GEMMs, attention scores, memory-bound bytes and engine cost into its compute time. With
constant rates every part is checked against the arithmetic by hand."""
import json

import pytest
from click.testing import CliRunner

from npmegatron.autograd import InputError
from npmegatron.bench.plan import calibrate as calibrate_module
from npmegatron.bench.plan import measure as measure_module
from npmegatron.cli import main
from npmegatron.config import GPTConfig
from npmegatron.perf import ParallelShape, load_profile
from npmegatron.perf.profiles import normalise
from npmegatron.perf.time_model import step_time
from npmegatron.perf.work import (attention_scores, layer_gemms, layer_traffic, log_interpolate,
                                  stage_seconds, traffic_seconds)
from npmegatron.tensor_parallel import pad_vocab_size

GEMM, SCORE, BANDWIDTH, LAYER, MICRO_BATCH = 1e11, (1e-9, 3e-9), 1e10, 1e-3, 5e-4


def constant_rates(gemm=GEMM, bandwidth=BANDWIDTH):
    """A measured entry whose every table is one constant (two grid points each)."""
    two = lambda value: [value, value]
    attention = {"seqs": [128, 1024], "head_dims": [32, 128]}
    for kind in ("none", "dropout"):
        attention[f"{kind}_forward"], attention[f"{kind}_backward"] = [two(SCORE[0])] * 2, [two(SCORE[1])] * 2
    return {"gemm": {"dims": [64, 4096], "flops": [[two(gemm)] * 2] * 2}, "attention": attention,
            "bandwidth": {"stream": {"elements": [1 << 16, 1 << 24], "bytes_per_s": two(bandwidth)}},
            "bandwidth_bytes_per_s": bandwidth, "layer_overhead_s": LAYER, "micro_batch_overhead_s": MICRO_BATCH}


def cpu_profile(**rates):
    link = {"alpha_s": 1e-5, "beta_s_per_byte": 1e-9}
    return normalise({"name": "test", "flops": 1e11, "devices_per_node": 2, "device_memory_bytes": 1e10,
                      "ranks_share_flops": True, "intra": link, "inter": link,
                      "measured": {"threads": {"1": constant_rates(**rates), "2": constant_rates(**rates)}}})


CFG = GPTConfig(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=256, max_position_embeddings=128,
                hidden_dropout=0.0, attention_dropout=0.0)


def shape(**kw):
    return ParallelShape(**{"seq": 128, "micro_batch": 2, "global_batch": 8, **kw})


def test_log_interpolate_is_exact_on_the_grid_geometric_between_and_clamped():
    axes, values = [[1, 4]], [10.0, 40.0]
    assert log_interpolate(axes, values, (1,)) == pytest.approx(10.0)
    assert log_interpolate(axes, values, (4,)) == pytest.approx(40.0)
    assert log_interpolate(axes, values, (2,)) == pytest.approx(20.0)        # halfway in log2: geometric mean
    assert log_interpolate(axes, values, (1000,)) == pytest.approx(40.0)
    assert log_interpolate([[1, 4], [1, 4]], [[1.0, 4.0], [4.0, 16.0]], (2, 2)) == pytest.approx(4.0)


def test_attention_scores_are_the_blocks_the_kernel_computes():
    assert attention_scores(128) == 128 * 128                  # one block sees every key
    assert attention_scores(256) == 128 * 128 + 128 * 256
    assert attention_scores(100) == 100 * 100


def test_every_part_of_compute_by_hand():
    s = shape()
    parts = step_time(CFG, s, cpu_profile())["compute_parts"]
    m, h, layers, micro_batches = 2 * 128, 64, 4, 4
    vocab = pad_vocab_size(256, 1, CFG.make_vocab_size_divisible_by)
    gemm_flops = 3 * (layers * 24 * m * h * h + 2 * m * h * vocab)        # forward and two backward each
    assert parts["gemm"] == pytest.approx(micro_batches * gemm_flops / GEMM)
    heads_scores = 2 * 4 * attention_scores(128)
    assert parts["attention"] == pytest.approx(micro_batches * layers * heads_scores * sum(SCORE))
    assert parts["engine"] == pytest.approx(micro_batches * (layers * LAYER + MICRO_BATCH))
    # memory-bound: the layers' ops, the ends and the gradient sum, all at the one bandwidth
    per_layer = sum(f + b for _, _, f, b in layer_traffic(CFG, s, 4))
    assert per_layer == 4 * m * (2 * 7 * h + 2 * 9 * h + 7 * 4 * h + 3 * 3 * h)
    stages = stage_seconds(CFG, s, cpu_profile()["measured"]["threads"]["2"], 0.0, 4)
    assert len(stages) == 1 and parts["memory_bound"] == pytest.approx(micro_batches * stages[0]["memory_bound"])
    assert parts["memory_bound"] > micro_batches * layers * per_layer / BANDWIDTH


def test_tensor_and_sequence_parallelism_divide_what_they_split():
    profile = cpu_profile()
    serial = step_time(CFG, shape(), profile)["compute_parts"]
    tp = step_time(CFG, shape(tp=2), profile)["compute_parts"]
    # two ranks on two cores: each its own core, so the layers' GEMMs halve (the head's vocabulary too)
    assert tp["gemm"] == pytest.approx(serial["gemm"] / 2)
    assert tp["attention"] == pytest.approx(serial["attention"] / 2)
    whole = lambda sp: [t for t in layer_traffic(CFG, shape(tp=2, sequence_parallel=sp), 4) if t[0] == "norm"]
    assert whole(True)[0][1] == whole(False)[0][1] // 2            # LayerNorm on a sequence shard under SP
    sp = step_time(CFG, shape(tp=2, sequence_parallel=True), profile)["compute_parts"]
    assert sp["memory_bound"] < tp["memory_bound"] and sp["gemm"] == pytest.approx(tp["gemm"])


def test_ranks_beyond_the_cores_share_them():
    profile = cpu_profile()
    two = step_time(CFG, shape(tp=2), profile)["compute"]
    four = step_time(CFG, shape(tp=2, dp=2), profile)["compute"]       # half the micro-batches, half a core
    assert four == pytest.approx(two)
    profile["measured"]["sharing_factor"] = 1.25                      # time-sliced ranks lose a quarter more
    assert step_time(CFG, shape(tp=2, dp=2), profile)["compute"] == pytest.approx(1.25 * two)
    assert step_time(CFG, shape(tp=2), profile)["compute"] == pytest.approx(two)
    profile["measured"]["threads"]["1"] = constant_rates(gemm=GEMM / 2)
    one_thread = step_time(CFG, shape(threads_per_rank=1), profile)["compute_parts"]  # bench scaling's --threads-per-rank
    assert one_thread["gemm"] == pytest.approx(2 * step_time(CFG, shape(), profile)["compute_parts"]["gemm"])


@pytest.mark.slow
def test_the_sharing_factor_is_measured_on_this_machine():
    """Two processes per core against one: at least 1, and not absurd."""
    assert 1.0 <= measure_module.sharing_factor(1, repeats=2, start_delay=0.4) < 10


def test_full_recomputation_runs_each_layers_forward_again():
    profile, s = cpu_profile(), shape()
    none = step_time(CFG, s, profile)["compute"]
    full = step_time(CFG, shape(recompute="full", recompute_num_layers=1), profile)["compute"]
    rates = profile["measured"]["threads"]["2"]
    forward = (sum(2 * 2 * 128 * k * n for _, k, n in layer_gemms(CFG, s)) / GEMM
               + 2 * 4 * attention_scores(128) * SCORE[0]
               + traffic_seconds(rates, layer_traffic(CFG, s, 4), 0) + LAYER / 2)
    assert full - none == pytest.approx(4 * 4 * forward)


def test_the_bubble_is_each_other_stages_micro_batch_once():
    profile = cpu_profile()
    s = shape(pp=2, global_batch=16)
    result = step_time(CFG, s, profile)
    rates = profile["measured"]["threads"]["1"]                # two ranks on two cores: one thread each
    stages = [sum(parts.values()) for parts in stage_seconds(CFG, s, rates, 0.0, 4)]
    assert stages[1] > stages[0]                                # the last stage holds the output layer
    assert result["compute"] == pytest.approx(s.micro_batches * max(stages))
    comm = result["pp_comm"] + result["tp_comm"] + result["cp_comm"]
    assert result["bubble"] == pytest.approx(min(stages) + comm / s.micro_batches)


def test_plan_prints_the_parts_of_compute(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(cpu_profile()))
    result = CliRunner().invoke(main, ["plan", "--profile", str(path), "--layout", "2x1x1"])
    assert result.exit_code == 0, result.output
    for name in ("GEMMs", "attention core", "memory-bound ops", "engine (Python, autograd)"):
        assert name in result.output


def records(tmp_path, *rows, name="results.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


RECORD = {"layout": "2x1x1", "tp": 2, "pp": 1, "dp": 1, "global_batch": 8, "micro_batch": 2, "seq": 128,
          "num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 256, "dtype": "float32",
          "step_s": 0.5}


def test_plan_against_a_scaling_run(tmp_path):
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps(cpu_profile()))
    path = records(tmp_path, RECORD, dict(RECORD, layout="1x1x1", tp=1, step_s=0.9))
    result = CliRunner().invoke(main, ["plan", "--profile", str(profile), "--against", path, "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)
    expected = step_time(CFG, shape(tp=2), load_profile(str(profile)))["total"]     # no dropout, as bench scaling
    dropout = dict(RECORD, hidden_dropout=0.1, attention_dropout=0.1)
    with_dropout = CliRunner().invoke(main, ["plan", "--profile", str(profile), "--json", "--against",
                                             records(tmp_path, dropout, name="dropout.jsonl")])
    assert json.loads(with_dropout.output)[0]["predicted_s"] > expected
    assert rows[0]["predicted_s"] == pytest.approx(expected)
    assert rows[0]["error"] == pytest.approx(expected / 0.5 - 1)
    table = CliRunner().invoke(main, ["plan", "--profile", str(profile), "--against", path]).output
    assert "1x1x1" in table and "%" in table


@pytest.mark.parametrize("content,needle", [
    ("not json\n", "is not a readable results.jsonl"),
    (json.dumps({"layout": "1x1x1"}) + "\n", "line 1 lacks tp"),
    ("", "holds no records"),
    (json.dumps(dict(RECORD, tp="two")) + "\n", "of the wrong type"),
    (json.dumps(dict(RECORD, pp=10 ** 9)) + "\n", "pp = 1000000000, of the wrong type or out of range"),
    (json.dumps(dict(RECORD, pp=3)) + "\n", "do not split evenly over PP 3"),
])
def test_a_bad_results_file_is_one_sentence(tmp_path, content, needle):
    path = tmp_path / "results.jsonl"
    path.write_text(content)
    result = CliRunner().invoke(main, ["plan", "--against", str(path)])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert result.output.count(needle) == 1, result.output


def test_measure_writes_a_profile_section_plan_accepts(monkeypatch):
    """The real measurements, on a small grid: every table the shape of its axes, every rate
    positive, and the profile they make plans."""
    monkeypatch.setattr(measure_module, "GEMM_DIMS", (64, 128))
    monkeypatch.setattr(measure_module, "ATTENTION_SEQS", (128, 256))
    monkeypatch.setattr(measure_module, "ATTENTION_HEAD_DIMS", (16, 32))
    monkeypatch.setattr(measure_module, "ATTENTION_SCORES", 1 << 16)
    monkeypatch.setattr(measure_module, "BANDWIDTH_ELEMENTS", (1 << 12, 1 << 14))
    monkeypatch.setattr(measure_module, "OP_WIDTHS", {k: 64 for k in measure_module.OP_WIDTHS})
    monkeypatch.setattr(measure_module, "OPTIMIZER_ELEMENTS", 1 << 12)
    entry = measure_module.measure(1)
    assert set(entry["bandwidth"]) == {"stream", "norm", "activation", "residual", "embedding", "loss"}
    profile = cpu_profile()
    profile["measured"] = {"threads": {"1": entry}}
    profile = normalise(profile)
    assert step_time(CFG, shape(), profile)["total"] > 0


def test_calibrate_adds_the_measured_rates(tmp_path, monkeypatch):
    from test_plan import fake_bench
    monkeypatch.setattr(calibrate_module, "run_bench", fake_bench)
    monkeypatch.setattr(calibrate_module, "measure", lambda threads, dtype: constant_rates(gemm=1e9 * threads))
    monkeypatch.setattr(calibrate_module, "sharing_factor", lambda cores: 1.1)
    output = tmp_path / "here.json"
    result = CliRunner().invoke(main, ["plan", "calibrate", "--output", str(output)])
    assert result.exit_code == 0, result.output
    profile = load_profile(str(output))
    assert "1" in profile["measured"]["threads"] and profile["measured"]["sharing_factor"] == 1.1
    assert step_time(CFG, shape(), profile)["compute_parts"]["gemm"] > 0


@pytest.mark.parametrize("change,needle", [
    (lambda m: m.update(threads={"one": {}}), "measured.threads key 'one'"),
    (lambda m: m["threads"]["1"]["gemm"].update(flops=[[1.0]]), "'measured.threads.1.gemm.flops' not shaped"),
    (lambda m: m["threads"]["1"]["gemm"].update(dims=[64, 64]), "'measured.threads.1.gemm.dims'"),
    (lambda m: m["threads"]["1"]["attention"].update(none_forward=[[0.0, 1.0], [1.0, 1.0]]), "a value 0.0 in"),
    (lambda m: m["threads"]["1"]["bandwidth"].pop("stream"), "lacks 'measured.threads.1.bandwidth.stream'"),
    (lambda m: m["threads"]["1"].update(bandwidth_bytes_per_s=0), "bandwidth_bytes_per_s = 0"),
    (lambda m: m["threads"]["1"].pop("layer_overhead_s"), "lacks the key 'measured.threads.1.layer_overhead_s'"),
    (lambda m: m.update(sharing_factor=0.5), "'measured.sharing_factor' = 0.5; it is a slowdown"),
])
def test_a_lying_measured_section_is_one_sentence(change, needle):
    profile = json.loads(json.dumps(cpu_profile()))
    change(profile["measured"])
    with pytest.raises(InputError) as error:
        normalise(profile, "p.json")
    assert needle in str(error.value) and str(error.value).count(". ") == 0
