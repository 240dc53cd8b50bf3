"""Host memory that goes back to the operating system: a fixed glibc mmap threshold."""

from __future__ import annotations

import ctypes
import os
import sys

# Note [a fixed mmap threshold for CPU training]
# glibc serves allocations above its mmap threshold with mmap (returned to the OS on free)
# and smaller ones from its heap, whose freed blocks the process keeps. The threshold
# adapts upwards to the largest block freed so far (up to 32 MiB), so after the first
# unit-sized buffer is freed, every later unit-sized transient (gradients, shards,
# staging) comes from the heap, and the heap's high-water mark, not the bytes in use,
# becomes the process's resident memory: measured on the state-heavy benchmark GPT, stage
# 3 held 528 MiB resident for 270 MiB of live tensors. A fixed threshold of 4 MiB keeps
# blocks that large out of the heap (359 MiB resident for the same run) while the
# activations of small and mid-sized models, allocated and freed every step, stay on the
# heap (no page faults). Set MESHSPEED_MMAP_THRESHOLD (bytes; 0 leaves glibc's default)
# to change it. It has no effect without glibc.
#
# Fixing the mmap threshold also stops glibc adapting its trim threshold, which then stays
# at its 128 KiB default: every time the end of a step frees the activations at the top of
# the heap, glibc gives those pages back, and the next step faults them in again. Measured
# on the ZeRO benchmark's GPT (5.3M parameters, 2 ranks, benchmarks/step_work.py's setup):
# about 12,000 minor page faults per step at stage 3 and 8,000 at stage 1, some 25 ms of
# kernel time per 500 ms step; with the trim threshold at 128 MiB, 70-220 faults and half
# the kernel time. So the trim threshold is fixed too, at DEFAULT_TRIM_THRESHOLD
# (MESHSPEED_TRIM_THRESHOLD to change it): up to that much freed heap may stay resident
# between steps (the peak, which is set while those bytes are in use, does not move), and
# offloaded steps give it back explicitly (Note [returning the freed heap after each
# offloaded step]).
#
# Note [a lower mmap threshold with state on NVMe]
# With the model state in swap files, host memory is the budget the run is sized by, and
# blocks of 1-4 MiB (a layer's 16-bit gradients and shards of mid-sized models, the
# copies held by writes in flight, the read-ahead's and the writes' timing deciding which
# of them outlive which) fragment the heap: measured on tests/offload/test_infinity.py's
# capped GPT (d_model 512, 2 MiB matrices), the peak RSS growth of one rank ranged over
# 226-426 MiB from run to run, the main heap holding up to 381 MiB free; with the
# threshold at 1 MiB it was 194-195 MiB in every run. A 1 MiB block costs 256 page faults
# per allocation, microseconds next to a step bound by the disk, so initialize lowers the
# threshold to OFFLOAD_MMAP_THRESHOLD when either offload goes to NVMe.
DEFAULT_MMAP_THRESHOLD = 4 << 20
OFFLOAD_MMAP_THRESHOLD = 1 << 20
DEFAULT_TRIM_THRESHOLD = 128 << 20
_M_MMAP_THRESHOLD = -3
_M_TRIM_THRESHOLD = -1
_tuned = 0  # the mmap threshold set, 0 before the first call


def tune_host_allocator(threshold: int = DEFAULT_MMAP_THRESHOLD) -> int:
    """Fix glibc's mmap and trim thresholds (Note [a fixed mmap threshold for CPU
    training]) at `threshold`, or lower a threshold set before to it (never raise it);
    MESHSPEED_MMAP_THRESHOLD, where set, wins. Returns the mmap threshold in effect, or 0
    when left alone."""
    global _tuned
    threshold = int(os.environ.get("MESHSPEED_MMAP_THRESHOLD", threshold))
    if threshold <= 0 or not sys.platform.startswith("linux"):
        return 0
    if _tuned and _tuned <= threshold:
        return _tuned
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return 0
    if not libc.mallopt(_M_MMAP_THRESHOLD, threshold):
        return _tuned
    trim = int(os.environ.get("MESHSPEED_TRIM_THRESHOLD", DEFAULT_TRIM_THRESHOLD))
    if not _tuned and trim > 0:
        libc.mallopt(_M_TRIM_THRESHOLD, trim)
    _tuned = threshold
    return threshold


# Note [returning the freed heap after each offloaded step]
# Below the mmap threshold, glibc keeps freed blocks in its heaps (one per thread that
# allocated: torch's intra-op threads and the swap threads each get an arena), and only
# the top of a heap is given back on its own. An offloaded step frees, at its end, what
# forward and backward allocated below the threshold (activations, small gathered
# parameters, per-parameter temporaries), scattered through the heaps: measured on the
# 0.2B benchmark GPT (benchmarks/infinity.py, everything on NVMe) 0.46 GiB of the 0.57 GiB
# of heap were free yet resident after three steps, and the peak grew by that much from
# step to step. `malloc_trim(0)` at the end of each offloaded step returns free pages of
# every arena to the OS (a walk of the heaps: milliseconds next to a step that moves the
# model's state through the disk), so each step starts from what is live.
_libc = None


def release_free_heap() -> bool:
    """Give glibc's free heap pages back to the OS (Note [returning the freed heap after
    each offloaded step]); False without glibc."""
    global _libc
    if not sys.platform.startswith("linux"):
        return False
    if _libc is None:
        try:
            _libc = ctypes.CDLL("libc.so.6")
        except OSError:
            _libc = False
    if not _libc:
        return False
    _libc.malloc_trim(0)
    return True
