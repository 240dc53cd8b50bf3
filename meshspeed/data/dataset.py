"""Fixed-length windows over a byte string, for next-byte prediction."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset


def _as_uint8(data: bytes | bytearray | memoryview | torch.Tensor) -> torch.Tensor:
    if isinstance(data, torch.Tensor):
        if data.dtype != torch.uint8 or data.dim() != 1:
            raise TypeError(f"expected a 1-D uint8 tensor, got {data.dtype} {tuple(data.shape)}")
        return data
    if len(data) == 0:  # torch.frombuffer rejects empty buffers
        return torch.empty(0, dtype=torch.uint8)
    # bytearray() copies once; torch.frombuffer on immutable bytes would warn.
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


class ByteWindows(Dataset):
    """Item i is `(x, y)`, two int64 tensors of length `seq_len` with `y[t] == x[t + 1]`.

    Window i starts at byte `i * stride`; the default stride `seq_len` gives non-overlapping
    inputs (each window reads `seq_len + 1` bytes, the last being the final target).
    """

    def __init__(
        self,
        data: bytes | bytearray | memoryview | torch.Tensor,
        seq_len: int,
        stride: int | None = None,
    ):
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        stride = seq_len if stride is None else stride
        if stride < 1:
            raise ValueError(f"stride must be >= 1, got {stride}")
        self.data = _as_uint8(data)
        self.seq_len = seq_len
        self.stride = stride

    def __len__(self) -> int:
        span = self.seq_len + 1  # bytes one window reads
        if len(self.data) < span:
            return 0
        return (len(self.data) - span) // self.stride + 1

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"window {i} out of range for {n} windows")
        start = i * self.stride
        chunk = self.data[start : start + self.seq_len + 1].long()  # (seq_len + 1,)
        return chunk[:-1], chunk[1:]

    def split(self, fraction: float) -> tuple[ByteWindows, ByteWindows]:
        """Cut the bytes at `fraction` into (train, val) datasets with the same windowing.

        The cut is on the bytes, not on window indices, so no byte is seen by both.
        """
        if not 0.0 < fraction < 1.0:
            raise ValueError(f"fraction must be in (0, 1), got {fraction}")
        cut = int(len(self.data) * fraction)
        return (
            ByteWindows(self.data[:cut], self.seq_len, self.stride),
            ByteWindows(self.data[cut:], self.seq_len, self.stride),
        )
