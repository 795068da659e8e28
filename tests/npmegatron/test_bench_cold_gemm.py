"""scripts/bench_cold_gemm.py: every Linear shape of the ceiling's rounds timed warm and cold, and
a step's total both ways."""
import importlib.util
import pathlib
import sys

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "bench_cold_gemm.py"


def load_script():
    spec = importlib.util.spec_from_file_location("bench_cold_gemm", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_times_each_linear_shape_warm_and_cold(monkeypatch, capsys):
    script = load_script()
    tiny = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 2, "seq_length": 16, "vocab_size": 64}
    monkeypatch.setitem(script.MODEL_PRESETS, "gpt2-124m", tiny)
    monkeypatch.setattr(sys, "argv", ["bench_cold_gemm.py", "--threads", "1", "--repeats", "2", "--evict-mib", "1"])
    script.main()
    lines = capsys.readouterr().out.splitlines()
    # the four Linear shapes of a layer and the output layer's, each forward and both backward ways
    assert len(lines) == 5 * 3 + 1
    assert all("warm" in line and "cold" in line and "%" in line for line in lines)
    assert lines[-1].startswith("a step's Linear GEMMs on ") and ": warm " in lines[-1]
    assert "(16, 32, 96)" in lines[0] and "x2" in lines[0]
