"""The GPU step from published rates (perf/published.py, the dgx2h profile's "published" section):
GEMM rates interpolated between published shapes and capped by their traffic, the 2019 code's
memory-bound kernels as passes over the tensors they touch, and the checks on the section."""
import json

import pytest

from npmegatron.autograd import InputError
from npmegatron.config import GPTConfig
from npmegatron.perf import ParallelShape, load_profile, step_time
from npmegatron.perf.profiles import resolve
from npmegatron.perf.published import gemm_seconds, interpolated_rate, layer_tensors

POINTS = [[1024, 1024, 1024, 50.0], [4096, 4096, 4096, 100.0], [64, 64, 64, 1.0],
          [16, 16, 16, 0.5], [8, 8, 8, 0.25], [4, 4, 4, 0.1]]


def test_a_published_shape_gets_its_own_rate_and_one_between_gets_a_rate_between():
    assert interpolated_rate(POINTS, 1024, 1024, 1024) == 50e12
    between = interpolated_rate(POINTS, 2048, 2048, 2048)
    assert 50e12 < between < 100e12
    # the four nearest only: the two tiny shapes furthest off do not pull a large GEMM down
    assert interpolated_rate(POINTS, 2048, 2048, 2048) == interpolated_rate(POINTS[:4], 2048, 2048, 2048)


def test_a_gemm_is_never_faster_than_its_traffic():
    published, bandwidth = {"gemm": {"2": POINTS}}, 1e12
    m, k, n = 4096, 4096, 4096
    assert gemm_seconds(published, bandwidth, 2, m, k, n) == pytest.approx(2 * m * k * n / 100e12)
    # inner size 8: each output read-and-written costs more than its 16 FLOPs at 100 TFLOP/s
    thin = gemm_seconds(published, bandwidth, 2, m, 8, n)
    assert thin == pytest.approx((m * 8 + 8 * n + m * n) * 2 / bandwidth)
    # a batch looks its rate up with its rows stacked, and moves every product's bytes
    batched = gemm_seconds(published, bandwidth, 2, 1024, 64, 1024, batch=16)
    rate = interpolated_rate(POINTS, 16 * 1024, 1024, 64)
    assert batched == pytest.approx(max(16 * 2 * 1024 * 64 * 1024 / rate,
                                        16 * (1024 * 64 * 2 + 1024 * 1024) * 2 / bandwidth))


def test_the_layer_tensors_follow_tp_sequence_parallelism_and_dropout():
    cfg = GPTConfig(num_layers=2, hidden_size=256, num_attention_heads=8, vocab_size=512,
                    max_position_embeddings=128, hidden_dropout=0.1, attention_dropout=0.1)
    scores, others = layer_tensors(cfg, ParallelShape(tp=2, micro_batch=4, seq=128))
    tokens = 4 * 128
    assert scores == [("scores", 4 * 4 * 128 * 128), ("dropout", 4 * 4 * 128 * 128)]
    assert dict(others[:4]) == {"hidden": tokens * 256, "qkv": tokens * 3 * 256 // 2, "context": tokens * 128,
                                "ffn": tokens * 1024 // 2}
    assert others[4:] == [("dropout", tokens * 256)] * 2
    _, sharded = layer_tensors(cfg, ParallelShape(tp=2, micro_batch=4, seq=128, sequence_parallel=True))
    assert sharded[0] == ("hidden", tokens * 256 // 2)
    quiet = GPTConfig(num_layers=2, hidden_size=256, num_attention_heads=8, vocab_size=512,
                      max_position_embeddings=128, hidden_dropout=0.0, attention_dropout=0.0)
    scores, others = layer_tensors(quiet, ParallelShape(micro_batch=4, seq=128))
    assert [name for name, _ in scores + others] == ["scores", "hidden", "qkv", "context", "ffn"]


def test_tp_halves_the_gemms_but_not_the_work_on_the_whole_hidden_size():
    profile = load_profile("dgx2h")
    cfg = GPTConfig(num_layers=4, hidden_size=2048, num_attention_heads=16, vocab_size=512,
                    max_position_embeddings=1024)
    base = dict(micro_batch=8, global_batch=8, seq=1024, element_bytes=2)
    one, two = (step_time(cfg, ParallelShape(tp=t, **base), profile)["compute_parts"] for t in (1, 2))
    assert two["gemm"] == pytest.approx(one["gemm"] / 2, rel=0.1)
    assert two["attention"] == pytest.approx(one["attention"] / 2, rel=0.1)
    assert two["memory_bound"] > 0.6 * one["memory_bound"] and "engine" not in one


def test_a_width_without_published_rates_is_one_sentence():
    profile = load_profile("dgx2h")
    cfg = GPTConfig(num_layers=2, hidden_size=256, num_attention_heads=8, vocab_size=512,
                    max_position_embeddings=128, dtype="float64")
    with pytest.raises(InputError, match="not this model's 8; plan it in one of those widths"):
        step_time(cfg, ParallelShape(seq=128), profile)


@pytest.mark.parametrize("change,needle", [
    (lambda p: p.pop("gemm"), "lacks 'published.gemm'"),
    (lambda p: p["gemm"].update({"3": [[1, 1, 1, 1.0]]}), "has published.gemm.3"),
    (lambda p: p["gemm"]["2"].append([1, 1, 1]), "entry [1, 1, 1]; each is [M, N, K, TFLOP/s]"),
    (lambda p: p["passes"].update({"qkv": [10 ** 400, 1]}), "published.passes.qkv = "),
    (lambda p: p["passes"].pop("scores"), "lacks 'published.passes.scores'"),
    (lambda p: p["passes"].update({"hidden": [1, -1]}), "published.passes.hidden = [1, -1]"),
    (lambda p: p.pop("loss_bytes_per_logit"), "lacks 'published.loss_bytes_per_logit'"),
    (lambda p: p.update({"optimizer_bytes_per_parameter": 0}), "optimizer_bytes_per_parameter = 0"),
])
def test_a_bad_published_section_is_one_sentence(tmp_path, change, needle):
    """Every one a single InputError naming the file, never a traceback at plan time."""
    raw = json.loads(open(resolve("dgx2h")).read())
    change(raw["published"])
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(InputError, match=needle.replace("[", r"\[").replace("]", r"\]")) as error:
        load_profile(str(path))
    assert "\n" not in str(error.value) and str(path) in str(error.value)


@pytest.mark.parametrize("value", [0, 10 ** 400])
def test_a_published_profile_needs_a_positive_finite_bandwidth(tmp_path, value):
    raw = json.loads(open(resolve("dgx2h")).read())
    raw["memory_bandwidth_bytes_per_s"] = value
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(InputError, match="memory_bandwidth_bytes_per_s") as error:
        load_profile(str(path))
    assert "\n" not in str(error.value)
