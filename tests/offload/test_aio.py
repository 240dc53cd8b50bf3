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


def _moved():
    from meshspeed.offload.aio import io_totals

    t = io_totals()
    return {k: t[k] for k in ("read_direct", "write_direct", "read_buffered", "write_buffered")}


@pytest.mark.skipif(not getattr(os, "O_DIRECT", 0), reason="no O_DIRECT on this platform")
def test_unaligned_ranges_go_direct_but_for_their_partial_end_blocks(tmp_path):
    """Note [O_DIRECT where it fits]: a range at an odd file offset, from memory at another
    block offset, moves its whole blocks direct (through the bounce buffer) and only the
    partial blocks at its ends through the page cache; the bytes round-trip exactly."""
    from meshspeed.offload.aio import buffered_bytes

    probe = str(tmp_path / "probe")
    try:  # tmpfs refuses O_DIRECT: nothing to check there
        os.close(os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o600))
    except OSError:
        pytest.skip("this file system refuses O_DIRECT")
    engine = SwapEngine(block_size=ALIGN * 2, thread_count=2)
    path = str(tmp_path / "f.master")
    base = torch.randn(6 * ALIGN // 4)
    engine.write(host_empty(base.numel(), align=ALIGN).copy_(base), path).wait()
    src = torch.randn(3 * ALIGN // 4 + 7)[1:]  # address 4 bytes past the allocator's 64
    offset = ALIGN + 100 * 4  # 400 bytes into a block
    before = _moved()
    engine.write(src, path, offset).wait()
    back = torch.empty(base.numel())
    engine.read(back, path).wait()
    after = _moved()
    expect = base.clone()
    expect[offset // 4 : offset // 4 + src.numel()] = src
    assert torch.equal(back, expect)
    nbytes = src.numel() * 4
    head = ALIGN - 400
    whole = (offset + nbytes) // ALIGN * ALIGN - (offset + head)
    assert after["write_direct"] - before["write_direct"] == whole
    assert after["write_buffered"] - before["write_buffered"] == nbytes - whole
    assert after["read_direct"] - before["read_direct"] == base.numel() * 4
    assert any(k.startswith("write *.master: partial") for k in buffered_bytes())
    part = torch.empty(src.numel())  # the same range read back: bounce + partial blocks
    engine.read(part, path, offset).wait()
    assert torch.equal(part, src)
    assert _moved()["read_direct"] - after["read_direct"] == whole
    engine.close()


def test_a_read_waits_for_an_earlier_write_of_its_range_from_any_engine(tmp_path, monkeypatch):
    """Note [a read never overtakes an earlier write]: a write held in flight on one engine;
    a read of an overlapping range on another engine waits for it, one of another range
    does not, and the write generation counts the write."""
    from meshspeed.offload import aio

    gate = threading.Event()
    real = aio._transfer

    def held(kind, *args):
        if kind == "write":
            gate.wait(10)
        return real(kind, *args)

    path = str(tmp_path / "f")
    writer, reader = SwapEngine(), SwapEngine()
    writer.write(torch.zeros(2048), path).wait()
    gen = aio.write_generation(path)
    monkeypatch.setattr(aio, "_transfer", held)
    w = writer.write(torch.ones(1024), path)  # bytes [0, 4096), held
    assert aio.write_generation(path) == gen + 1
    other = torch.full((1024,), 5.0)
    reader.read(other, path, offset=4096).wait()  # another range: not held up
    assert not w.done() and torch.equal(other, torch.zeros(1024))
    got = torch.empty(1024)
    t = threading.Thread(target=lambda: reader.read(got, path).wait())
    t.start()
    t.join(0.3)
    assert t.is_alive()  # waits for the write in flight
    gate.set()
    t.join(10)
    assert torch.equal(got, torch.ones(1024))
    writer.close()
    reader.close()
