"""preprocess's default --workers: the cores this process may run on, and no more than a container's
CPU quota (cgroup v2's cpu.max, v1's cpu.cfs_quota_us / cpu.cfs_period_us), read from a folder
standing in for /sys/fs/cgroup; what cannot be read is no quota."""
import os

import pytest

from npmegatron.data.tokenizing import cpu_quota, default_workers

CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cgroup(root, files):
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text) if isinstance(text, bytes) else path.write_text(text)
    return str(root)


@pytest.mark.parametrize("files, quota", [
    ({"cpu.max": "200000 100000\n"}, 2),
    ({"cpu.max": "150000 100000\n"}, 2),                    # 1.5 CPUs: rounded up
    ({"cpu.max": "5000 100000\n"}, 1),                      # a twentieth of a CPU: at least one
    ({"cpu.max": "max 100000\n"}, None),
    ({"cpu.max": "\n"}, None),
    ({"cpu.max": "lots 100000\n"}, None),
    ({"cpu.max": "100000 0\n"}, None),
    ({"cpu.max": b"\xff\xfe 100000\n"}, None),
    ({"cpu/cpu.cfs_quota_us": "300000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 3),
    ({"cpu,cpuacct/cpu.cfs_quota_us": "50000\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"}, 1),
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    ({"cpu/cpu.cfs_quota_us": "300000\n"}, None),            # no period: not a quota that can be read
    ({}, None),
], ids=["v2-two", "v2-rounded-up", "v2-at-least-one", "v2-max", "v2-empty", "v2-not-a-number", "v2-period-0",
        "v2-not-text", "v1-three", "v1-cpuacct", "v1-unlimited", "v1-no-period", "none"])
def test_the_cpu_quota_is_read_defensively(tmp_path, files, quota):
    root = cgroup(tmp_path, files)
    assert cpu_quota(root) == quota
    assert default_workers(root) == (CORES if quota is None else min(CORES, quota))


def test_a_quota_below_the_cores_is_the_default(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    assert default_workers(cgroup(tmp_path, {"cpu.max": "250000 100000\n"})) == 3
    assert default_workers(cgroup(tmp_path / "wide", {"cpu.max": "1600000 100000\n"})) == 8


def test_a_folder_that_cannot_be_read_is_no_quota(tmp_path):
    (tmp_path / "cpu.max").mkdir()                           # a folder where the file should be
    assert cpu_quota(str(tmp_path)) is None
    assert cpu_quota(str(tmp_path / "missing")) is None
