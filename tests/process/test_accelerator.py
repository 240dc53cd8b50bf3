"""The accelerator layer on a CPU-only machine (CUDA paths run where a GPU exists)."""

from __future__ import annotations

import pytest
import torch

from meshspeed.process.accelerator import CpuAccelerator, get_accelerator

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_detection_picks_cuda_only_when_available():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert get_accelerator().name == expected
    assert get_accelerator() is get_accelerator()  # a cached factory, not a new object each call


def test_cpu_accelerator_basics():
    acc = get_accelerator("cpu")
    assert acc.device(3) == torch.device("cpu")
    assert acc.default_backend() == "gloo"
    assert acc.supports_bf16()
    acc.set_device(0)
    acc.synchronize()
    t = torch.ones(4)
    assert acc.pin_memory(t) is t  # no device to pin for: unchanged
    assert not acc.is_pin_available()


def test_cpu_memory_is_process_rss_and_tracks_allocations():
    acc = CpuAccelerator()
    acc.reset_peak_memory_stats()
    before = acc.memory_allocated()
    assert before > 10 * 2**20  # an interpreter with torch loaded is well over 10 MiB
    # 64 MiB, touched so it is resident: above glibc's largest mmap threshold (32 MiB), so it
    # is fresh pages whatever earlier tests left free in this process's heap
    block = torch.ones(64 * 2**20 // 4)
    assert acc.memory_allocated() - before > 48 * 2**20
    del block
    assert acc.max_memory_allocated() - before > 48 * 2**20  # the peak remembers it
    acc.reset_peak_memory_stats()
    assert acc.max_memory_allocated() < before + 48 * 2**20
    stats = acc.memory_stats()
    assert stats["allocated_bytes.all.peak"] >= stats["allocated_bytes.all.current"] > 0


def test_unknown_or_missing_device_types_are_errors():
    with pytest.raises(ValueError, match="unknown device type 'tpu'"):
        get_accelerator("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="'cuda' requested but not available"):
            get_accelerator("cuda")


@requires_cuda
def test_cuda_accelerator():
    acc = get_accelerator("cuda")
    assert acc.default_backend() == "nccl"
    assert acc.device(0) == torch.device("cuda", 0)
    acc.reset_peak_memory_stats()
    x = torch.empty(2**20, device=acc.device(0))
    assert acc.memory_allocated() >= x.numel() * 4
    assert acc.max_memory_allocated() >= acc.memory_allocated()
    pinned = acc.pin_memory(torch.ones(4))
    assert pinned.is_pinned() and acc.pin_memory(pinned) is pinned
