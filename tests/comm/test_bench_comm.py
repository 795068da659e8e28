"""`npmegatron bench comm`: launched by mpiexec or launching it, a table, a fit and a JSON line."""
import json
import subprocess
import sys

import pytest

from helpers import ROOT, mpiexec_path, rank_environment

ARGS = ["bench", "comm", "--min-bytes", "1024", "--max-bytes", "65536"]


def check_report(stdout, ranks):
    record = json.loads(stdout.strip().splitlines()[-1])
    assert record["ranks"] == ranks
    assert {r["op"] for r in record["table"]} == {"all_reduce", "all_gather", "reduce_scatter", "sendrecv"}
    assert [r["bytes"] for r in record["table"] if r["op"] == "all_reduce"] == [1024, 4096, 16384, 65536]
    assert all(r["seconds"] > 0 for r in record["table"])
    assert set(record["fits"]) == {"all_reduce", "all_gather", "reduce_scatter", "sendrecv"}
    assert stdout.count("alpha-beta fit") == 1       # printed by rank 0 only


def test_bench_comm_launched_by_mpiexec():
    result = subprocess.run([mpiexec_path(), "-n", "2", sys.executable, "-m", "npmegatron.cli"] + ARGS,
                            capture_output=True, text=True, timeout=120, cwd=ROOT, env=rank_environment())
    assert result.returncode == 0, result.stderr
    check_report(result.stdout, 2)


@pytest.mark.slow
def test_bench_comm_launches_mpiexec_itself():
    result = subprocess.run([sys.executable, "-m", "npmegatron.cli"] + ARGS + ["--ranks", "4"],
                            capture_output=True, text=True, timeout=120, cwd=ROOT, env=rank_environment())
    assert result.returncode == 0, result.stderr
    check_report(result.stdout, 4)


def test_bench_comm_bad_sizes_are_one_sentence():
    result = subprocess.run([sys.executable, "-m", "npmegatron.cli", "bench", "comm", "--min-bytes", "0"],
                            capture_output=True, text=True, timeout=60, cwd=ROOT, env=rank_environment())
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "--min-bytes 0 and --max-bytes" in result.stderr
