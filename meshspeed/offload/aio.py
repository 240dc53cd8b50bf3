"""The swap engine: asynchronous tensor reads and writes to files, in background threads.

Each request moves one contiguous byte range between a host tensor and a file. It is cut
into `thread_count` contiguous parts (one per worker thread, unless `single_submit`),
and each part is written or read in `block_size` system calls (`os.pwritev` /
`os.preadv`, which release the GIL). `submit` returns an `IoRequest` at once; `wait()`
on it blocks until every part is done and re-raises the first I/O error with its file.

Note [O_DIRECT where it fits]
With `direct=True` (the default where the file system accepts it), files are opened with
O_DIRECT so swapped state goes to the device rather than into the page cache, where it
would compete with the memory offload is trying to free. O_DIRECT needs the buffer
address, file offset and length to be multiples of the logical block size: requests that
are not (`hostmem.ALIGN`, 4096) fall back to buffered I/O, so correctness never depends
on alignment. The swap store sizes its files and buffers to keep every request aligned.

`queue_depth` bounds the requests in flight: a further `submit` waits for one to finish
(back-pressure instead of unbounded queues of pinned buffers). With `overlap_events`
false, a request is not started until the previous one has finished.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from meshspeed.offload.hostmem import ALIGN

_O_DIRECT = getattr(os, "O_DIRECT", 0)
# bytes submitted by every engine of this process, and the seconds during which at least
# one request was in flight (the disk was kept busy by this process)
_TOTALS = {"read": 0, "write": 0, "busy_s": 0.0}
_TOTALS_LOCK = threading.Lock()
_IN_FLIGHT = [0, 0.0]  # requests in flight, time the count last left 0


def io_totals() -> dict[str, float]:
    """Bytes read and written by swap engines in this process so far, and the seconds with
    a request in flight (benchmarks take differences around a step: its I/O volume, and
    busy / step time says how much of the step the disk had work)."""
    with _TOTALS_LOCK:
        out = dict(_TOTALS)
        if _IN_FLIGHT[0]:
            out["busy_s"] += time.perf_counter() - _IN_FLIGHT[1]
        return out


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
        with _TOTALS_LOCK:
            _TOTALS[kind] += len(view)
        if not self.overlap_events and self._last is not None:
            self._last.wait()
        self._slots.acquire()  # queue_depth: wait for a free slot
        try:
            parts = self._split(len(view))
            direct = self.direct and _aligned(t.data_ptr(), offset, len(view))
            if kind == "write":
                _ensure_file(path)
            _started()
            futures = [self._pool.submit(_transfer, kind, path, view[a:b], offset + a,
                                         self.block_size, direct) for a, b in parts]
        except BaseException:
            _finished()
            self._slots.release()
            raise
        remaining = [len(futures)]
        lock = threading.Lock()

        def part_done(_f):
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                _finished()
                self._slots.release()

        for f in futures:
            f.add_done_callback(part_done)
        req = IoRequest(kind, path, len(view), futures)
        self._last = req
        return req

    def _split(self, nbytes: int) -> list[tuple[int, int]]:
        if nbytes == 0:
            return [(0, 0)]
        n = 1 if self.single_submit else max(1, min(self.thread_count, nbytes // self.block_size))
        step = -(-nbytes // n // ALIGN) * ALIGN or nbytes  # part boundaries stay aligned
        return [(a, min(a + step, nbytes)) for a in range(0, nbytes, step)]


def _aligned(address: int, offset: int, nbytes: int) -> bool:
    return address % ALIGN == 0 and offset % ALIGN == 0 and nbytes % ALIGN == 0


def _ensure_file(path: str) -> None:
    if not os.path.exists(path):
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))


def _open(path: str, kind: str, direct: bool) -> int:
    flags = os.O_RDONLY if kind == "read" else os.O_WRONLY
    if direct:
        try:
            return os.open(path, flags | _O_DIRECT)
        except OSError as err:  # tmpfs and some network file systems refuse O_DIRECT
            if err.errno != errno.EINVAL:
                raise
    return os.open(path, flags)


def _transfer(kind: str, path: str, view: memoryview, offset: int, block: int, direct: bool) -> None:
    fd = _open(path, kind, direct)
    try:
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
    finally:
        os.close(fd)
