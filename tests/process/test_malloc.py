"""glibc's mmap threshold (meshspeed/process/malloc.py): fixed at 4 MiB for CPU training,
lowered to 1 MiB with state on NVMe and never raised again, MESHSPEED_MMAP_THRESHOLD
winning over both. Each case runs in a fresh interpreter: the threshold is per process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Allocates a 2 MiB block before and after each call and reports whether glibc served it
# with mmap (mallinfo2's hblkhd grows while the block is alive): the threshold in effect,
# observed, not the value returned.
PROBE = r"""
import ctypes, json, sys
from meshspeed.process.malloc import OFFLOAD_MMAP_THRESHOLD, tune_host_allocator

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p

def mmapped(nbytes):
    libc.malloc_trim(0)  # no free heap left to serve it from: the threshold decides
    before = libc.mallinfo2().hblkhd
    block = libc.malloc(nbytes)
    grew = libc.mallinfo2().hblkhd > before
    libc.free(ctypes.c_void_p(block))
    return grew

out = {"set": tune_host_allocator(), "2MiB_after_default": mmapped(2 << 20)}
out["lowered"] = tune_host_allocator(OFFLOAD_MMAP_THRESHOLD)
out["2MiB_after_lowering"] = mmapped(2 << 20)
out["again_default"] = tune_host_allocator()
out["2MiB_after_default_again"] = mmapped(2 << 20)
print(json.dumps(out))
"""


def _probe(**env) -> dict:
    full = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    if "MESHSPEED_MMAP_THRESHOLD" not in env:
        full.pop("MESHSPEED_MMAP_THRESHOLD", None)
    proc = subprocess.run([sys.executable, "-c", PROBE], env=full, cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")


def test_nvme_offload_lowers_the_threshold_and_nothing_raises_it_again():
    r = _probe()
    assert r["set"] == 4 << 20 and not r["2MiB_after_default"], r  # 2 MiB: from the heap
    assert r["lowered"] == 1 << 20 and r["2MiB_after_lowering"], r  # now mmapped
    assert r["again_default"] == 1 << 20 and r["2MiB_after_default_again"], r


def test_the_environment_variable_wins_over_both():
    r = _probe(MESHSPEED_MMAP_THRESHOLD=str(8 << 20))
    assert r["set"] == r["lowered"] == r["again_default"] == 8 << 20, r
    assert not r["2MiB_after_lowering"], r
