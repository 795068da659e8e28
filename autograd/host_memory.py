"""Keep freed host memory in the process, as PyTorch's CPU allocator caches its blocks.

glibc returns the top of its heap to the kernel once 2 x the mmap threshold (32 MiB at most)
lies free, and serves large arrays with fresh mmaps: every training step then faults in its
activations again, page by page, and the kernel zeroes each page. With arrays up to 32 MiB served
from the heap, the heap grown 256 MiB at a time and trimmed only above 2 GiB free, a step reuses
the pages of the last one. Measured on the reference model (`bench step`, 2 cores): minor page
faults per run 240,000 -> 77,000, system time 3.3-3.5 -> 2.3-2.6 s, step 2.09-2.20 -> 1.99-2.07 s.

Arrays above 32 MiB (glibc's largest mmap threshold) are served from the heap too: mmap is turned
off (M_MMAP_MAX 0). A step's vocabulary-sized arrays (GPT-2 124M's logits and the loss's kept
exponentials, 206 MB each at micro-batch 1) then reuse the last step's pages: the step's page
faults fell from about 100,000 to a few dozen, the loss's forward from 76 to 53 ms and the
embedding's from 19 to 1 ms (2 cores). The price: memory freed below the top of the heap stays
with the process for the next allocation instead of going back to the kernel, so the resident
size stays at the run's peak; a training run is at its peak every step anyway.

NumPy asks the kernel for transparent huge pages on large arrays (madvise). Where the kernel's THP
defrag setting is "madvise", such a fault compacts memory on the spot, and a step's
vocabulary-sized arrays then wait for it: the loss's first pass over a fresh 206 MB array took
180-360 ms instead of about 100 ms with plain pages (2 cores, GPT-2 124M, micro-batch 1), and the
step 4.21-4.28 s instead of 3.91-4.08 s. So there NumPy is told not to ask."""
import ctypes
import ctypes.util

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -2, -3, -4


def keep_freed_memory():
    """Tune glibc's malloc (mallopt); a no-op where there is no glibc. True when applied."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return all(mallopt(option, value) == 1 for option, value in (
        (_M_MMAP_THRESHOLD, 32 << 20), (_M_TOP_PAD, 256 << 20), (_M_TRIM_THRESHOLD, (1 << 31) - 1), (_M_MMAP_MAX, 0)))


THP_DEFRAG = "/sys/kernel/mm/transparent_hugepage/defrag"


def no_stalling_huge_pages():
    """Turn off NumPy's huge-page advice where the kernel would compact memory synchronously to
    honour it (THP defrag "[madvise]"); True when turned off."""
    try:
        with open(THP_DEFRAG) as f:
            if "[madvise]" not in f.read():
                return False
    except OSError:
        return False
    import numpy
    core = getattr(numpy, "_core", None) or numpy.core
    setter = getattr(core.multiarray, "_set_madvise_hugepage", None)
    if setter is None:
        return False
    setter(False)
    return True
