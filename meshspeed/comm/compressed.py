"""Error-compensated 1-bit all-reduce (1-bit Adam, Tang et al., arXiv:2102.02888, Alg. 1).

A list of fp32 tensors is averaged over a group while each rank sends one bit per element
plus a few fp32 scales:

    worker stage  x += worker_error; s = |x| / sqrt(n); signs of x, packed 8 per byte;
                  worker_error = x - s * sign(x)                (error feedback)
                  (one s per tensor of the list: Note [layout of the compressed buffer])
                  all-to-all: rank j receives chunk j of every rank's signs;
                  all-gather of the N worker scales
    server stage  rank j averages its chunk, sum_r s_r * sign_r / N; compresses that the
                  same way with its server_error; all-gather of the N packed chunks and of
                  the N server scales; every rank unpacks the same result

`sign(0)` is +1. Each tensor is padded to a multiple of 8N elements so that every chunk
packs into whole bytes (the padding is zeros and is dropped again).

Note [compressed all-reduce bytes]: per call, each rank moves (Note [ring bytes] in
counter.py)
    all_to_all  (N-1)/N * P/8      worker signs
    all_gather  (N-1)/N * P/8      server signs
    all_gather  2 * (N-1) * 4T     worker and server scales (N x T fp32 each)
with P the sum of the T tensors' padded counts: 2(N-1)/N * P/8 + 8T(N-1) bytes, against
2(N-1)/N * 4n for the fp32 all-reduce of the same n elements: 1/32 of it plus the
scales. `compressed_allreduce_bytes` computes it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from meshspeed.comm.collectives import all_gather_into_tensor, all_to_all_single, get_world_size

__all__ = [
    "CompressedAllReduce",
    "compress_",
    "compress_segments_",
    "compressed_allreduce_bytes",
    "pack_signs",
    "padded_numel",
    "unpack_signs",
]

# bit i of a byte (most significant first) holds element i of its group of 8
_BIT_WEIGHTS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)


def padded_numel(numel: int, world: int) -> int:
    """`numel` rounded up to a multiple of 8 * world (whole bytes in every rank's chunk)."""
    unit = 8 * world
    return unit * math.ceil(numel / unit)


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """One bit per element of `x` (1 where x >= 0), 8 per uint8; `x.numel()` % 8 == 0."""
    if x.numel() % 8:
        raise ValueError(f"pack_signs needs a multiple of 8 elements, got {x.numel()}")
    bits = (x.reshape(-1, 8) >= 0).to(torch.uint8)
    return (bits * _BIT_WEIGHTS.to(x.device)).sum(1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """+1 / -1 per bit of `packed` (8 values per byte), the inverse of `pack_signs`."""
    bits = packed.reshape(-1, 1).bitwise_and(_BIT_WEIGHTS.to(packed.device)).ne(0)
    return bits.reshape(-1).to(dtype).mul_(2).sub_(1)


def compress_(x: torch.Tensor, error: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Error-compensated sign compression of `x` (changed in place: x += error).

    Returns (packed signs, scale) with scale = |x + error| / sqrt(n), and leaves in `error`
    what the compressed value `scale * sign` misses of x + error, to be added next time."""
    x.add_(error)
    scale = x.norm() / math.sqrt(x.numel())
    signs = torch.where(x >= 0, 1.0, -1.0).to(x.dtype)
    torch.sub(x, signs * scale, out=error)
    return pack_signs(x), scale.reshape(1)


def compress_segments_(x: torch.Tensor, error: torch.Tensor, segment_of: torch.Tensor,
                       counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`compress_` with one scale per segment of columns: `x` and `error` are (rows, C),
    `segment_of` (C,) names each column's segment, `counts` (S,) the elements per segment
    over all rows. Returns (packed signs (rows, C/8), scales (S,))."""
    x.add_(error)
    sums = torch.zeros(counts.numel(), dtype=x.dtype, device=x.device)
    sums.index_add_(0, segment_of, x.pow(2).sum(0))
    scales = sums.div_(counts).sqrt_()
    signs = torch.where(x >= 0, 1.0, -1.0).to(x.dtype)
    torch.sub(x, signs * scales[segment_of], out=error)
    return pack_signs(x).view(x.shape[0], -1), scales


def compressed_allreduce_bytes(sizes: int | Sequence[int], world: int) -> int:
    """Bytes one rank moves in one `CompressedAllReduce` call on tensors of `sizes`
    elements, as CommCounter counts them (Note [compressed all-reduce bytes])."""
    sizes = [sizes] if isinstance(sizes, int) else list(sizes)
    if world == 1:
        return 0
    packed = sum(padded_numel(n, world) for n in sizes) // 8
    return 2 * ((world - 1) * packed // world) + 2 * 4 * len(sizes) * (world - 1)


class CompressedAllReduce:
    """Averages a list of fp32 tensors of `sizes` elements over `group` in 1 bit per element,
    with one scale per tensor (as DeepSpeed's per-parameter calls), in 4 collectives.

    Note [layout of the compressed buffer]: tensor t, padded to P_t = a multiple of 8N, is
    viewed as (N, P_t / N); these blocks side by side make the (N, C) worker buffer, so row
    j holds chunk j of every tensor and goes to rank j whole in the all-to-all; rank j's
    server buffer is one (C,) row, whose column segments are still the tensors.

    Holds the two error-feedback buffers (this rank's worker error over the whole padded
    buffer, its server error over its row), so one instance serves tensors whose meaning
    stays the same from call to call (1-bit Adam's momenta)."""

    def __init__(self, sizes: int | Sequence[int], group: Any = None, device: torch.device | str = "cpu"):
        self.sizes = [sizes] if isinstance(sizes, int) else list(sizes)
        self.numel = sum(self.sizes)
        self.group = group
        self.world = n = get_world_size(group)
        widths = [padded_numel(size, n) // n for size in self.sizes]  # columns per tensor
        self.widths = widths
        self.columns = sum(widths)
        ids = torch.arange(len(widths), device=device)
        self.segment_of = ids.repeat_interleave(torch.tensor(widths, device=device))
        width = torch.tensor(widths, dtype=torch.float32, device=device)
        self.worker_counts, self.server_counts = width * n, width
        self.worker_error = torch.zeros(n, self.columns, device=device)
        self.server_error = torch.zeros(1, self.columns, device=device)

    def reset(self) -> None:
        """Forget the accumulated errors (after loading a checkpoint, as DeepSpeed does)."""
        self.worker_error.zero_()
        self.server_error.zero_()

    def _layout(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        x = torch.zeros(self.world, self.columns, device=tensors[0].device)
        start = 0
        for t, width in zip(tensors, self.widths):
            block = torch.zeros(self.world * width, device=t.device)
            block[: t.numel()] = t.reshape(-1)
            x[:, start: start + width] = block.view(self.world, width)
            start += width
        return x

    def __call__(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Replace each fp32 tensor by its (compressed) average over the group, in place."""
        if [t.numel() for t in tensors] != self.sizes or any(t.dtype != torch.float32 for t in tensors):
            raise ValueError(f"CompressedAllReduce built for fp32 tensors of {self.sizes} elements, got "
                             f"{[t.numel() for t in tensors]} ({', '.join(str(t.dtype) for t in tensors)})")
        n = self.world
        x = self._layout(tensors)
        # worker stage: row j of every rank's signs goes to rank j
        signs, scales = compress_segments_(x, self.worker_error, self.segment_of, self.worker_counts)
        received = torch.empty_like(signs)
        all_to_all_single(received, signs, group=self.group)
        all_scales = torch.empty(n * scales.numel(), device=x.device)  # flat: gloo's shape rule
        all_gather_into_tensor(all_scales, scales, group=self.group)
        all_scales = all_scales.view(n, -1)
        # server stage: this rank's row, averaged over the ranks, compressed again
        votes = unpack_signs(received).view(n, self.columns)
        mine = (votes * all_scales[:, self.segment_of]).sum(0, keepdim=True).div_(n)
        server_signs, server_scales = compress_segments_(mine, self.server_error, self.segment_of,
                                                         self.server_counts)
        gathered = torch.empty(n * self.columns // 8, dtype=torch.uint8, device=x.device)
        all_gather_into_tensor(gathered, server_signs.view(-1), group=self.group)
        all_server_scales = torch.empty(n * server_scales.numel(), device=x.device)
        all_gather_into_tensor(all_server_scales, server_scales, group=self.group)
        result = unpack_signs(gathered).view(n, self.columns)
        result.mul_(all_server_scales.view(n, -1)[:, self.segment_of])
        start = 0
        for t, width in zip(tensors, self.widths):
            t.copy_(result[:, start: start + width].reshape(-1)[: t.numel()].view_as(t))
            start += width
        return tensors
