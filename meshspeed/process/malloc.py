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
# A lower threshold trades speed for a steadier peak. Measured with everything on NVMe:
# at 1 MiB, the capped GPT of tests/offload/test_infinity.py (d_model 512, 2 MiB
# matrices) peaked at 194-195 MiB above its start in every run, against 226-426 MiB at
# 4 MiB (its main heap holding up to 381 MiB free); but forward + backward of the 0.3B
# GPT (benchmarks/infinity.py --tutorial-config) took 6.1-6.3 s against 4.9-5.4 s, and
# the 2B step's forward + backward 40-48 s against 26-32 s: the activations above 1 MiB
# are then page-faulted in every step. The default stays at 4 MiB; that test sets 1 MiB.
DEFAULT_MMAP_THRESHOLD = 4 << 20
DEFAULT_TRIM_THRESHOLD = 128 << 20
_M_MMAP_THRESHOLD = -3
_M_TRIM_THRESHOLD = -1
_tuned = False


def tune_host_allocator() -> int:
    """Fix glibc's mmap and trim thresholds once per process (Note [a fixed mmap threshold
    for CPU training]); returns the mmap threshold set, or 0 when left alone."""
    global _tuned
    threshold = int(os.environ.get("MESHSPEED_MMAP_THRESHOLD", DEFAULT_MMAP_THRESHOLD))
    if _tuned or threshold <= 0 or not sys.platform.startswith("linux"):
        return 0
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return 0
    _tuned = bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold))
    trim = int(os.environ.get("MESHSPEED_TRIM_THRESHOLD", DEFAULT_TRIM_THRESHOLD))
    if _tuned and trim > 0:
        libc.mallopt(_M_TRIM_THRESHOLD, trim)
    return threshold if _tuned else 0


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
