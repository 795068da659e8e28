"""Machine profiles and layouts given to `npmegatron plan` are input (issue 26): a profile that
lies is one sentence naming the file and the key, never a traceback or a plan from nonsense."""
import json

import pytest
from click.testing import CliRunner
from hypothesis import strategies as st

from hostile import BUDGETS, check_property, one_sentence
from npmegatron.autograd import InputError
from npmegatron.perf import ParallelShape, load_profile
from npmegatron.perf.profiles import resolve
from npmegatron.perf.search import plan
from npmegatron.cli import main
from npmegatron.config import GPTConfig

CPU_PROFILE = {"name": "laptop", "flops": 8e10, "devices_per_node": 2, "device_memory_bytes": 2.4e10,
               "ranks_share_flops": True, "flops_by_threads": {"1": 4e10, "2": 8e10},
               "intra": {"alpha_s": 2e-5, "beta_s_per_byte": 2e-10},
               "inter": {"alpha_s": 2e-5, "beta_s_per_byte": 2e-10}}
CFG = GPTConfig(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=256, max_position_embeddings=64)


def planned(profile_file):
    return plan(CFG, ParallelShape(tp=2, pp=2, dp=1, seq=64, micro_batch=2, global_batch=8), load_profile(profile_file), None)


def written(tmp_path, change):
    profile = json.loads(json.dumps(CPU_PROFILE))
    change(profile)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile))
    return str(path)


LIES = [
    pytest.param(lambda p: p.update(flops_by_threads={"one": 4e10}), "flops_by_threads key 'one'", id="threads-key"),
    pytest.param(lambda p: p.update(flops_by_threads={"1": "fast"}), "'flops_by_threads.1' = 'fast'", id="threads-rate"),
    pytest.param(lambda p: p.update(flops_by_threads=[4e10]), "'flops_by_threads' = [40000000000.0]", id="threads-list"),
    pytest.param(lambda p: p.update(ranks_share_flops="false"), "'ranks_share_flops' = 'false'", id="share-string"),
    pytest.param(lambda p: p.update(devices_per_node=2.5), "'devices_per_node' = 2.5; it must be a whole number",
                 id="devices-fraction"),
    pytest.param(lambda p: p.update(dp_overlap=3), "'dp_overlap' = 3; it is a share of backward", id="overlap-above-1"),
    pytest.param(lambda p: p.update(name=["x"]), "'name' = ['x']; it must be a string", id="name-type"),
    pytest.param(lambda p: p.update(flops_recompute=["full"]), "flops_recompute ['full']", id="recompute-type"),
    pytest.param(lambda p: p.update(device={"gemm": {"bf16": [[1, 1, 1, 0]]}}), "device.gemm.bf16", id="device-gemm"),
    pytest.param(lambda p: p.update(peak_flops={"bf16": float("nan")}), "'peak_flops.bf16' = nan", id="peak-nan"),
]


@pytest.mark.parametrize("change,message", LIES)
def test_a_lying_profile_is_one_sentence(tmp_path, change, message):
    with pytest.raises(InputError) as error:
        planned(written(tmp_path, change))
    assert message in one_sentence(error.value)


def test_a_deeply_nested_profile_is_one_sentence(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text("[" * 100000 + "]" * 100000)
    with pytest.raises(InputError, match="is not readable JSON"):
        load_profile(str(path))


@pytest.mark.parametrize("layout", ["²x1x1", "1x1x99999999", "1x1", "0x1x1", "ax1x1"])
def test_a_bad_plan_layout_is_one_sentence(layout):
    result = CliRunner().invoke(main, ["plan", "--layout", layout])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert result.output.count("is not TPxPPxDP") == 1, result.output


@pytest.mark.parametrize("examples", BUDGETS)
def test_mutated_profiles_plan_or_are_refused_in_one_sentence(tmp_path, examples):
    shipped = json.loads(open(resolve("dgx2h")).read())
    gpu = json.loads(open(resolve("h200")).read())
    keys = sorted(set(shipped) | set(gpu) | set(CPU_PROFILE))
    values = (st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats() | st.text(max_size=6)
              | st.lists(st.floats(), max_size=2) | st.dictionaries(st.text(max_size=3), st.floats(), max_size=2))

    def check(case):
        base, key, how, value = case
        profile = dict(base)
        if how == "delete":
            profile.pop(key, None)
        else:
            profile[key] = value
        path = tmp_path / "profile.json"
        path.write_text(json.dumps(profile))
        try:
            planned(str(path))
        except InputError as error:
            one_sentence(error)

    check_property(st.tuples(st.sampled_from([shipped, gpu, CPU_PROFILE]), st.sampled_from(keys),
                             st.sampled_from(["replace", "delete"]), values), check, examples)
