"""glibc's mmap threshold (meshspeed/process/malloc.py): fixed at 4 MiB for CPU training,
MESHSPEED_MMAP_THRESHOLD winning. Each case runs in a fresh interpreter (the threshold
is per process) and observes where glibc puts a block, not what the function returns."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# mallinfo2's hblkhd grows while a block glibc mmapped is alive; malloc_trim first, so
# that no free heap is left to serve the block from and the threshold decides
PROBE = r"""
import ctypes, json
from meshspeed.process.malloc import tune_host_allocator

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p

def mmapped(nbytes):
    libc.malloc_trim(0)
    before = libc.mallinfo2().hblkhd
    block = libc.malloc(nbytes)
    grew = libc.mallinfo2().hblkhd > before
    libc.free(ctypes.c_void_p(block))
    return grew

print(json.dumps({"set": tune_host_allocator(), "2MiB": mmapped(2 << 20), "8MiB": mmapped(8 << 20)}))
"""

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")


def _probe(**env) -> dict:
    full = {k: v for k, v in os.environ.items() if k != "MESHSPEED_MMAP_THRESHOLD"}
    proc = subprocess.run([sys.executable, "-c", PROBE], env={**full, "PYTHONPATH": str(ROOT), **env},
                          cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_default_threshold_is_4_mib():
    r = _probe()
    assert r == {"set": 4 << 20, "2MiB": False, "8MiB": True}, r


def test_the_environment_variable_sets_it():
    r = _probe(MESHSPEED_MMAP_THRESHOLD=str(1 << 20))
    assert r == {"set": 1 << 20, "2MiB": True, "8MiB": True}, r
