"""The swap engine: asynchronous tensor reads and writes to files, in background threads.

Each request moves one contiguous byte range between a host tensor and a file. It is cut
into `thread_count` contiguous parts (one per worker thread, unless `single_submit`),
and each part is written or read in `block_size` system calls (`os.pwritev` /
`os.preadv`, which release the GIL). `submit` returns an `IoRequest` at once; `wait()`
on it blocks until every part is done and re-raises the first I/O error with its file.

Note [O_DIRECT where it fits]
With `direct=True` (the default where the file system accepts it), files are opened with
O_DIRECT so swapped state goes to the device rather than into the page cache, where it
would compete with the memory offload is trying to free, and where a write "completes"
at memory speed and reaches the disk later (a step timed that way looks faster than the
disk). O_DIRECT needs the buffer address, file offset and length to be multiples of the
logical block size (`hostmem.ALIGN`, 4096). A request that is not aligned is cut at the
file's block boundaries:
  - the whole blocks in the middle go direct: straight from the caller's tensor when its
    address has the same offset within a block as the file position, else through an
    aligned bounce buffer of `block_size` bytes (one copy in memory; each engine holds
    `thread_count` of them from its start, 2 MiB with the defaults of 1 MiB x 2);
  - the partial blocks at either end (under 4096 bytes each) go through the page cache.
A partial block is never written direct, so a block is only ever written one way at a
time and Linux keeps the two paths coherent (a direct read or write first writes back
and drops the cached pages of its range). `io_totals()` counts the bytes that went each
way, and `buffered_bytes()` says which files and why (the benchmark prints it).

Note [a read never overtakes an earlier write]
Every engine of the process records its writes in flight by file and byte range. A read
or a write of an overlapping range submitted later waits for them first (in the
submitting thread, before it takes a queue slot). So a caller may return from a step
with its write-back still in flight (write-behind): whoever reads those bytes next, the
next forward's shard fetch or a checkpoint, sees the new values whichever engine it
uses. A write that overtakes an earlier *read* is not ordered: callers wait for their
reads before reusing or rewriting the memory or the file range. `write_generation(path)`
counts the writes submitted to a file, so a reader that read ahead can tell that its
copy may be stale.

`queue_depth` bounds the requests in flight: a further `submit` waits for one to finish
(back-pressure instead of unbounded queues of pinned buffers). With `overlap_events`
false, a request is not started until the previous one has finished.
"""

from __future__ import annotations

import errno
import os
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from meshspeed.offload.hostmem import ALIGN, host_empty

_O_DIRECT = getattr(os, "O_DIRECT", 0)
# bytes submitted by every engine of this process (and how they went: direct, or through
# the page cache), and the seconds during which at least one request was in flight (the
# disk was kept busy by this process)
_TOTALS = {"read": 0, "write": 0, "read_direct": 0, "write_direct": 0,
           "read_buffered": 0, "write_buffered": 0, "busy_s": 0.0}
_BUFFERED: dict[tuple[str, str, str], int] = {}  # (kind, file suffix, why) -> bytes
_TOTALS_LOCK = threading.Lock()
_IN_FLIGHT = [0, 0.0]  # requests in flight, time the count last left 0

_PARTIAL = "partial 4 KiB blocks at the ends of an unaligned range"
_REFUSED = "the file system refused O_DIRECT"
_OFF = "direct I/O off (aio setting or no O_DIRECT)"


def io_totals() -> dict[str, float]:
    """Bytes read and written by swap engines in this process so far (and of those, the
    bytes that went direct and through the page cache), and the seconds with a request in
    flight (benchmarks take differences around a step: its I/O volume, and busy / step time
    says how much of the step the disk had work)."""
    with _TOTALS_LOCK:
        out = dict(_TOTALS)
        if _IN_FLIGHT[0]:
            out["busy_s"] += time.perf_counter() - _IN_FLIGHT[1]
        return out


def buffered_bytes() -> dict[str, int]:
    """Bytes that went through the page cache so far, by "kind *.suffix: why"."""
    with _TOTALS_LOCK:
        return {f"{k} *{s}: {why}": n for (k, s, why), n in sorted(_BUFFERED.items())}


def _count(kind: str, path: str, direct: int, buffered: int, why: str) -> None:
    with _TOTALS_LOCK:
        _TOTALS[f"{kind}_direct"] += direct
        _TOTALS[f"{kind}_buffered"] += buffered
        if buffered:
            key = (kind, os.path.splitext(path)[1] or os.path.basename(path), why)
            _BUFFERED[key] = _BUFFERED.get(key, 0) + buffered


def _started() -> None:
    with _TOTALS_LOCK:
        if _IN_FLIGHT[0] == 0:
            _IN_FLIGHT[1] = time.perf_counter()
        _IN_FLIGHT[0] += 1


def _finished() -> None:
    with _TOTALS_LOCK:
        _IN_FLIGHT[0] -= 1
        if _IN_FLIGHT[0] == 0:
            _TOTALS["busy_s"] += time.perf_counter() - _IN_FLIGHT[1]


# -- Note [a read never overtakes an earlier write] ------------------------------------------
_WRITES: dict[str, list[tuple[int, int, IoRequest]]] = {}  # path -> writes in flight
_GENERATION: dict[str, int] = {}
_WRITES_LOCK = threading.Lock()


def write_generation(path: str) -> int:
    """How many writes to `path` have been submitted in this process."""
    with _WRITES_LOCK:
        return _GENERATION.get(path, 0)


def _earlier_writes(path: str, start: int, end: int) -> list[IoRequest]:
    with _WRITES_LOCK:
        live = [w for w in _WRITES.get(path, ()) if not w[2].done()]
        if live:
            _WRITES[path] = live
        else:
            _WRITES.pop(path, None)
        return [r for a, b, r in live if a < end and start < b]


def _record_write(path: str, start: int, end: int, req: IoRequest) -> None:
    with _WRITES_LOCK:
        _WRITES.setdefault(path, []).append((start, end, req))
        _GENERATION[path] = _GENERATION.get(path, 0) + 1


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable, zero-copy memoryview of a contiguous host tensor's bytes."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("swap I/O needs a contiguous host tensor")
    return memoryview(t.view(-1).view(torch.uint8).numpy()).cast("B")


class IoRequest:
    """One submitted read or write; `wait()` blocks until it is complete."""

    def __init__(self, kind: str, path: str, nbytes: int, parts: list[Future]):
        self.kind, self.path, self.nbytes = kind, path, nbytes
        self._parts = parts

    def done(self) -> bool:
        return all(f.done() for f in self._parts)

    def wait(self) -> None:
        for f in self._parts:
            err = f.exception()
            if err is not None:
                raise OSError(f"swap {self.kind} of {self.nbytes} bytes, {self.path}: {err}") from err


class SwapEngine:
    """Thread-pool file I/O for host tensors (see module docstring)."""

    def __init__(self, *, block_size: int = 1 << 20, queue_depth: int = 8, thread_count: int = 1,
                 single_submit: bool = False, overlap_events: bool = True, direct: bool = True):
        self.block_size = max(ALIGN, block_size // ALIGN * ALIGN)  # keep blocks O_DIRECT-sized
        self.thread_count = thread_count
        self.single_submit = single_submit
        self.overlap_events = overlap_events
        self.direct = direct and bool(_O_DIRECT)
        self._slots = threading.BoundedSemaphore(queue_depth)
        self._bounce: queue.SimpleQueue = queue.SimpleQueue()  # one per worker thread
        if self.direct:
            for _ in range(thread_count):
                buf = host_empty(self.block_size, torch.uint8, align=ALIGN)
                self._bounce.put((buf, byte_view(buf)))
        self._pool = ThreadPoolExecutor(max_workers=thread_count, thread_name_prefix="meshspeed-aio")
        self._last: IoRequest | None = None
        self._closed = False

    # -- public ---------------------------------------------------------------------------
    def write(self, src: torch.Tensor, path: str, offset: int = 0) -> IoRequest:
        """Write `src`'s bytes to `path` at byte `offset` (the file is created if missing)."""
        return self._submit("write", src, path, offset)

    def read(self, dst: torch.Tensor, path: str, offset: int = 0) -> IoRequest:
        """Fill `dst` from `path` at byte `offset`."""
        return self._submit("read", dst, path, offset)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._pool.shutdown(wait=True)

    # -- internals ------------------------------------------------------------------------
    def _submit(self, kind: str, t: torch.Tensor, path: str, offset: int) -> IoRequest:
        if self._closed:
            raise RuntimeError("swap engine is closed")
        view = byte_view(t)
        nbytes = len(view)
        with _TOTALS_LOCK:
            _TOTALS[kind] += nbytes
        for earlier in _earlier_writes(path, offset, offset + nbytes):
            earlier.wait()  # Note [a read never overtakes an earlier write]
        if not self.overlap_events and self._last is not None:
            self._last.wait()
        self._slots.acquire()  # queue_depth: wait for a free slot
        try:
            parts = self._plan(t.data_ptr(), offset, nbytes)
            if kind == "write":
                _ensure_file(path)
            _started()
            flat = t.view(-1).view(torch.uint8)
            futures = [self._pool.submit(_transfer, kind, path, flat[a:b], view[a:b], offset + a,
                                         self.block_size, mode, self._bounce) for a, b, mode in parts]
        except BaseException:
            _finished()
            self._slots.release()
            raise
        remaining = [len(futures)]
        lock = threading.Lock()

        def part_done(f):
            err = f.exception()
            if err is None:
                direct, buffered, why = f.result()
                _count(kind, path, direct, buffered, why)
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                _finished()
                self._slots.release()

        req = IoRequest(kind, path, nbytes, futures)
        if kind == "write":
            _record_write(path, offset, offset + nbytes, req)
        for f in futures:
            f.add_done_callback(part_done)
        self._last = req
        return req

    def _plan(self, address: int, offset: int, nbytes: int) -> list[tuple[int, int, str]]:
        """(start, end, mode) parts of a request, in bytes from its start: the whole file
        blocks "direct" (or "bounce" when the memory is not at the same block offset as the
        file), the partial blocks at the ends "buffered" (Note [O_DIRECT where it fits])."""
        if nbytes == 0:
            return [(0, 0, "buffered")]
        if not self.direct:
            return [(0, nbytes, "off")]
        head = min(nbytes, (-offset) % ALIGN)
        tail_start = max(head, (offset + nbytes) // ALIGN * ALIGN - offset)
        out = [(0, head, "buffered")] if head else []
        mode = "direct" if (address + head) % ALIGN == 0 else "bounce"
        out += [(a, b, mode) for a, b in self._split(head, tail_start)]
        if tail_start < nbytes:
            out.append((tail_start, nbytes, "buffered"))
        return out

    def _split(self, start: int, end: int) -> list[tuple[int, int]]:
        """[start, end) (whole blocks) in `thread_count` parts with block-aligned bounds."""
        nbytes = end - start
        if nbytes <= 0:
            return []
        n = 1 if self.single_submit else max(1, min(self.thread_count, nbytes // self.block_size))
        step = -(-nbytes // n // ALIGN) * ALIGN
        return [(a, min(a + step, end)) for a in range(start, end, step)]


def _ensure_file(path: str) -> None:
    if not os.path.exists(path):
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))


def _open(path: str, kind: str, direct: bool) -> tuple[int, bool]:
    flags = os.O_RDONLY if kind == "read" else os.O_WRONLY
    if direct:
        try:
            return os.open(path, flags | _O_DIRECT), True
        except OSError as err:  # tmpfs and some network file systems refuse O_DIRECT
            if err.errno != errno.EINVAL:
                raise
    return os.open(path, flags), False


def _transfer(kind: str, path: str, flat: torch.Tensor, view: memoryview, offset: int, block: int,
              mode: str, bounce: queue.SimpleQueue) -> tuple[int, int, str]:
    """Move one part; returns (bytes direct, bytes buffered, why buffered)."""
    fd, direct = _open(path, kind, mode in ("direct", "bounce"))
    total = len(view)
    try:
        if mode == "bounce" and direct:
            buf = bounce.get()  # (as many as worker threads: never waits)
            try:
                _bounced(fd, kind, flat, offset, block, buf)
            finally:
                bounce.put(buf)
        else:
            _plain(fd, kind, view, offset, block)
    finally:
        os.close(fd)
    if direct:
        return total, 0, ""
    why = {"buffered": _PARTIAL, "off": _OFF}.get(mode, _REFUSED)
    return 0, total, why


def _plain(fd: int, kind: str, view: memoryview, offset: int, block: int) -> None:
    done, total = 0, len(view)
    while done < total:
        chunk = view[done : min(done + block, total)]
        if kind == "write":
            n = os.pwritev(fd, [chunk], offset + done)
        else:
            n = os.preadv(fd, [chunk], offset + done)
            if n == 0:
                raise OSError(errno.EIO, f"unexpected end of file at byte {offset + done}")
        done += n


def _bounced(fd: int, kind: str, flat: torch.Tensor, offset: int, block: int,
             bounce: tuple[torch.Tensor, memoryview]) -> None:
    """Whole blocks between memory at another block offset and the file, through an
    aligned buffer (torch's copy releases the GIL, a memoryview copy would not)."""
    buf, bview = bounce
    done, total = 0, flat.numel()
    while done < total:
        n = min(block, total - done)
        if kind == "write":
            buf[:n].copy_(flat[done : done + n])
            got = 0
            while got < n:
                got += os.pwritev(fd, [bview[got:n]], offset + done + got)
        else:
            got = 0
            while got < n:
                r = os.preadv(fd, [bview[got:n]], offset + done + got)
                if r == 0:
                    raise OSError(errno.EIO, f"unexpected end of file at byte {offset + done + got}")
                got += r
            flat[done : done + n].copy_(buf[:n])
        done += n
