"""The swap engine and swap directories, in one process."""

import os
import threading

import pytest
import torch

from meshspeed.config import ConfigError
from meshspeed.offload.aio import SwapEngine
from meshspeed.offload.hostmem import ALIGN, host_empty
from meshspeed.offload.swapdir import SwapDir, check_nvme_path


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("threads, single", [(1, False), (3, False), (3, True)])
def test_roundtrip(tmp_path, direct, threads, single):
    engine = SwapEngine(block_size=ALIGN * 2, thread_count=threads, single_submit=single,
                        direct=direct)
    aligned = host_empty(10 * ALIGN // 4, align=ALIGN).copy_(torch.randn(10 * ALIGN // 4))
    odd = torch.randn(1001)  # neither address nor length aligned: buffered fallback
    path = str(tmp_path / "f")
    engine.write(aligned, path).wait()
    engine.write(odd, path, offset=aligned.numel() * 4).wait()
    back_aligned = host_empty(aligned.numel(), align=ALIGN)
    back_odd = torch.empty_like(odd)
    r1 = engine.read(back_aligned, path)
    r2 = engine.read(back_odd, path, offset=aligned.numel() * 4)
    r1.wait()
    r2.wait()
    assert torch.equal(back_aligned, aligned) and torch.equal(back_odd, odd)
    assert os.path.getsize(path) == aligned.numel() * 4 + odd.numel() * 4
    engine.close()


def test_read_past_end_is_an_error_naming_the_file(tmp_path):
    engine = SwapEngine()
    path = str(tmp_path / "short")
    engine.write(torch.zeros(4), path).wait()
    with pytest.raises(OSError, match="short"):
        engine.read(torch.empty(8), path).wait()
    with pytest.raises(OSError, match="missing"):
        engine.read(torch.empty(8), str(tmp_path / "missing")).wait()
    engine.close()


def test_queue_depth_bounds_requests_in_flight(tmp_path, monkeypatch):
    from meshspeed.offload import aio

    gate = threading.Event()
    active, peak = [0], [0]
    lock = threading.Lock()
    real = aio._transfer

    def slow(*args):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        gate.wait(5)
        try:
            return real(*args)
        finally:
            with lock:
                active[0] -= 1

    monkeypatch.setattr(aio, "_transfer", slow)
    engine = SwapEngine(queue_depth=2, thread_count=4)
    reqs = []
    t = threading.Thread(target=lambda: reqs.extend(
        engine.write(torch.ones(16), str(tmp_path / f"f{i}")) for i in range(3)))
    t.start()
    t.join(0.5)
    assert t.is_alive()  # the third submit waits for a free slot
    gate.set()
    t.join(5)
    for r in reqs:
        r.wait()
    assert peak[0] <= 2
    engine.close()


def test_swapdir_per_rank_and_removed(tmp_path):
    a, b = SwapDir(str(tmp_path), 0), SwapDir(str(tmp_path), 0)
    assert a.path != b.path and f"rank0-{os.getpid()}" in a.path
    with open(os.path.join(a.sub("optimizer"), "x"), "wb") as f:
        f.write(b"12345")
    assert a.file_bytes() == 5
    a.close()
    assert not os.path.exists(a.path) and a.closed
    path = b.path
    del b  # the weakref finalizer removes it when collected
    import gc

    gc.collect()
    assert not os.path.exists(path)


def test_check_nvme_path(tmp_path):
    check_nvme_path(str(tmp_path), "k")
    with pytest.raises(ConfigError, match="k: required"):
        check_nvme_path(None, "k")
    with pytest.raises(ConfigError, match="does not exist"):
        check_nvme_path(str(tmp_path / "x"), "k")
