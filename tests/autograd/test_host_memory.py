"""The host memory policy npmegatron sets on import (autograd/host_memory.py): glibc keeps freed
memory, and NumPy's huge-page advice is off exactly where the kernel would compact memory on the
spot to honour it."""
import resource

import numpy
import pytest

import npmegatron  # noqa: F401  (applies the policy)
from npmegatron.autograd import host_memory


def advice_on():
    core = getattr(numpy, "_core", None) or numpy.core
    return core.multiarray._get_madvise_hugepage()


def test_huge_page_advice_follows_the_kernels_defrag_setting(tmp_path, monkeypatch):
    core = getattr(numpy, "_core", None) or numpy.core
    before = advice_on()
    try:
        for setting, expect_off in (("always defer defer+madvise [madvise] never", True),
                                    ("always defer [defer+madvise] madvise never", False),
                                    ("[always] defer defer+madvise madvise never", False)):
            core.multiarray._set_madvise_hugepage(True)
            path = tmp_path / "defrag"
            path.write_text(setting + "\n")
            monkeypatch.setattr(host_memory, "THP_DEFRAG", str(path))
            assert host_memory.no_stalling_huge_pages() is expect_off
            assert advice_on() is (not expect_off)
        monkeypatch.setattr(host_memory, "THP_DEFRAG", str(tmp_path / "absent"))
        assert host_memory.no_stalling_huge_pages() is False
    finally:
        core.multiarray._set_madvise_hugepage(before)


def test_a_large_array_reuses_the_pages_of_the_last_one_freed():
    """64 MiB, above glibc's largest mmap threshold: served from the heap, so allocating and
    filling it again faults in no fresh pages (16,384 faults as a new mmap)."""
    if not host_memory.keep_freed_memory():
        pytest.skip("no glibc malloc to tune here")
    numpy.ones(16 << 20, numpy.float32)         # allocated, filled and freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    again = numpy.ones(16 << 20, numpy.float32)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert again.sum() == 16 << 20
    assert faults < 1_000
