"""The host memory policy npmegatron sets on import (autograd/host_memory.py): glibc keeps freed
memory, and NumPy's huge-page advice stays on."""
import resource
import subprocess
import sys

import numpy
import pytest

import npmegatron  # noqa: F401  (applies the policy)
from npmegatron.autograd import host_memory


def advice_on():
    core = getattr(numpy, "_core", None) or numpy.core
    return core.multiarray._get_madvise_hugepage()


def test_numpys_huge_page_advice_is_left_as_numpy_sets_it():
    """With the heap keeping freed memory, huge pages are faulted in during the first step only:
    npmegatron leaves NumPy's advice as NumPy alone sets it (on, on Linux)."""
    alone = subprocess.run([sys.executable, "-c", "import numpy; core = getattr(numpy, '_core', None) "
                            "or numpy.core; print(core.multiarray._get_madvise_hugepage())"],
                           capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    assert str(advice_on()) == alone


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
