"""Bytes of host memory in use, exactly: glibc's allocator counters (`mallinfo2`).

RSS is a noisy measure of what a piece of code holds (pages freed but not returned,
pages touched by other threads); the allocator's own count of bytes handed out and not
freed is exact, and torch allocates CPU tensors with malloc. `HeapPeak` samples it at
chosen call sites (before and after each call) to find the most held at once.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Self

_FIELDS = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
           "uordblks", "fordblks", "keepcost")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in _FIELDS]


_libc = ctypes.CDLL(None)
_mallinfo2 = getattr(_libc, "mallinfo2", None)  # glibc >= 2.33
if _mallinfo2 is not None:
    _mallinfo2.restype = _MallInfo2


def available() -> bool:
    return _mallinfo2 is not None


def heap_bytes() -> int:
    """Bytes malloc has handed out and not had back (small blocks + mmapped large ones)."""
    info = _mallinfo2()
    return info.uordblks + info.hblkhd


class HeapPeak:
    """`with HeapPeak([(module_or_class, "attribute"), ...]) as peak:` ... `peak.growth`:
    the most bytes in use above those at entry, sampled around each call to the named
    functions (patched for the duration of the block)."""

    def __init__(self, points: list[tuple[object, str]]):
        self.points = points
        self.base = self.peak = 0
        self._saved: list[tuple[object, str, object]] = []

    @property
    def growth(self) -> int:
        return self.peak - self.base

    def sample(self) -> None:
        self.peak = max(self.peak, heap_bytes())

    def _wrap(self, fn):
        @functools.wraps(fn)
        def sampled(*args, **kwargs):
            self.sample()
            try:
                return fn(*args, **kwargs)
            finally:
                self.sample()
        return sampled

    def __enter__(self) -> Self:
        self.base = self.peak = heap_bytes()
        for owner, name in self.points:
            fn = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
            self._saved.append((owner, name, fn))
            setattr(owner, name, self._wrap(fn))
        return self

    def __exit__(self, *exc) -> None:
        self.sample()
        for owner, name, fn in reversed(self._saved):
            setattr(owner, name, fn)
        self._saved.clear()
