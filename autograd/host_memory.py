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

NumPy asks the kernel for transparent huge pages on arrays of 4 MiB or more (madvise), and
npmegatron leaves that on. Where the kernel's THP defrag setting is "madvise" such a fault
compacts memory on the spot; while every step's large arrays were fresh mmaps, every step waited
for it. Served from the heap, a step's arrays are faulted in during the first step only, and the
later steps run with fewer TLB misses: GPT-2 124M, micro-batch 1, 2 cores, 6 alternating pairs of
`bench step --iters 5`: steps of 2941-3219 ms with the advice against 3108-3372 ms without it (5
pairs of 6 faster); the first step 3.85 s against 4.41 s; the reference model unchanged."""
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

