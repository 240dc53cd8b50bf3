"""Host memory that goes back to the operating system: released pages, a fixed mmap threshold.

Note [releasing pages, not storage, on the CPU]
A stage-3 unit's full parameters are dropped after each use and refilled before the
next. On an accelerator the storage is freed and re-allocated (its caching allocator
makes that cheap and compact). On the CPU, freeing and re-allocating unit-sized buffers
many times a step fragments glibc's heap: freed blocks are kept by the process (its
mmap threshold adapts upwards to the sizes freed), so the process's resident memory
keeps the high-water mark of every layout the heap went through, which can be several
times the memory actually in use. Instead the buffer stays allocated and its whole
pages are handed back with madvise(MADV_DONTNEED): resident memory drops at once, the
address range stays valid, and the next write (the all-gather) faults fresh zero pages
in. Only whole pages inside the buffer are released (at most two partial pages stay).
"""

from __future__ import annotations

import ctypes
import mmap
import sys

import torch

_MADV_DONTNEED = 4
_libc = None


def _madvise():
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        except (OSError, AttributeError):
            _libc = False
    return _libc.madvise if _libc else None


def can_release_pages(device: torch.device) -> bool:
    return device.type == "cpu" and sys.platform.startswith("linux") and _madvise() is not None


def release_pages(t: torch.Tensor) -> int:
    """Hand the whole pages of `t`'s storage back to the OS (contents become zeros);
    returns the bytes released."""
    storage = t.untyped_storage()
    start, size = storage.data_ptr(), storage.nbytes()
    page = mmap.PAGESIZE
    lo = -(-start // page) * page
    hi = (start + size) // page * page
    if hi <= lo:
        return 0
    if _madvise()(lo, hi - lo, _MADV_DONTNEED) != 0:
        raise OSError(ctypes.get_errno(), "madvise(MADV_DONTNEED) failed on a stage-3 buffer")
    return hi - lo


# Note [a fixed mmap threshold for CPU training]
# glibc serves allocations above its mmap threshold with mmap (returned to the OS on free)
# and smaller ones from its heap, whose freed blocks the process keeps. The threshold
# adapts upwards to the largest block freed so far (up to 32 MiB), so after the first
# unit-sized buffer is freed, every later unit-sized transient (gradients, shards,
# staging) comes from the heap, and the heap's high-water mark, not the bytes in use,
# becomes the process's resident memory: measured on the state-heavy benchmark GPT, stage
# 3 held 528 MiB resident for 270 MiB of live tensors. A fixed threshold of 4 MiB keeps
# blocks that large out of the heap (363 MiB resident for the same run) while the
# activations of small and mid-sized models, allocated and freed every step, stay on the
# heap (no page faults). Set MESHSPEED_MMAP_THRESHOLD (bytes; 0 leaves glibc's default)
# to change it. It has no effect without glibc.
DEFAULT_MMAP_THRESHOLD = 4 << 20
_M_MMAP_THRESHOLD = -3
_tuned = False


def tune_host_allocator() -> int:
    """Fix glibc's mmap threshold once per process (Note [a fixed mmap threshold for CPU
    training]); returns the threshold set, or 0 when left alone."""
    global _tuned
    import os

    threshold = int(os.environ.get("MESHSPEED_MMAP_THRESHOLD", DEFAULT_MMAP_THRESHOLD))
    if _tuned or threshold <= 0 or not sys.platform.startswith("linux"):
        return 0
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return 0
    _tuned = bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold))
    return threshold if _tuned else 0
