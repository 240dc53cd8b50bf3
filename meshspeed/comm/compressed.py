"""Error-compensated 1-bit all-reduce (1-bit Adam, Tang et al., arXiv:2102.02888, Alg. 1).

A flat fp32 tensor is averaged over a group while each rank sends one bit per element
plus a few fp32 scales:

    worker stage  x += worker_error; s = |x| / sqrt(n); signs of x, packed 8 per byte;
                  worker_error = x - s * sign(x)                (error feedback)
                  all-to-all: rank j receives chunk j of every rank's signs;
                  all-gather of the N worker scales
    server stage  rank j averages its chunk, sum_r s_r * sign_r / N; compresses that the
                  same way with its server_error; all-gather of the N packed chunks and of
                  the N server scales; every rank unpacks the same result

`sign(0)` is +1. The tensor is padded to a multiple of 8N elements so that every chunk
packs into whole bytes (the padding is zeros and is dropped again).

Note [compressed all-reduce bytes]: per call, each rank moves (Note [ring bytes] in
counter.py, P the padded element count)
    all_to_all  (N-1)/N * P/8      worker signs
    all_gather  (N-1)/N * P/8      server signs
    all_gather  2 * (N-1) * 4      worker and server scales (N fp32 each)
that is 2(N-1)/N * P/8 + 8(N-1) bytes, against 2(N-1)/N * 4n for the fp32 all-reduce of
the same n elements: 1/32 of it plus the scales. `compressed_allreduce_bytes` computes it.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from meshspeed.comm.collectives import all_gather_into_tensor, all_to_all_single, get_world_size

__all__ = [
    "CompressedAllReduce",
    "compress_",
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


def compressed_allreduce_bytes(numel: int, world: int) -> int:
    """Bytes one rank moves in one `CompressedAllReduce` call on `numel` elements, as
    CommCounter counts them (Note [compressed all-reduce bytes])."""
    if world == 1:
        return 0
    packed = padded_numel(numel, world) // 8
    return 2 * ((world - 1) * packed // world) + 2 * 4 * (world - 1)


class CompressedAllReduce:
    """Averages flat fp32 tensors of `numel` elements over `group` in 1 bit per element.

    Holds the two error-feedback buffers (this rank's worker error over the whole padded
    tensor, its server error over its chunk), so one instance serves one tensor whose
    meaning stays the same from call to call (1-bit Adam's momentum)."""

    def __init__(self, numel: int, group: Any = None, device: torch.device | str = "cpu"):
        self.numel = numel
        self.group = group
        self.world = get_world_size(group)
        self.padded = padded_numel(numel, self.world)
        self.chunk = self.padded // self.world
        self.worker_error = torch.zeros(self.padded, device=device)
        self.server_error = torch.zeros(self.chunk, device=device)

    def reset(self) -> None:
        """Forget the accumulated errors (after loading a checkpoint, as DeepSpeed does)."""
        self.worker_error.zero_()
        self.server_error.zero_()

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        """Replace the flat fp32 `tensor` by the (compressed) average over the group."""
        if tensor.numel() != self.numel or tensor.dtype != torch.float32:
            raise ValueError(f"CompressedAllReduce built for {self.numel} fp32 elements, "
                             f"got {tensor.numel()} {tensor.dtype}")
        n, chunk_bytes = self.world, self.chunk // 8
        x = torch.zeros(self.padded, device=tensor.device)
        x[: self.numel] = tensor.reshape(-1)
        # worker stage: chunk j of every rank's signs goes to rank j
        signs, scale = compress_(x, self.worker_error)
        received = torch.empty_like(signs)
        all_to_all_single(received, signs, group=self.group)
        scales = torch.empty(n, device=x.device)
        all_gather_into_tensor(scales, scale, group=self.group)
        # server stage: this rank's chunk, averaged over the ranks, compressed again
        votes = unpack_signs(received).view(n, self.chunk)
        mine = (votes * scales.view(n, 1)).sum(0).div_(n)
        server_signs, server_scale = compress_(mine, self.server_error)
        gathered = torch.empty(n * chunk_bytes, dtype=torch.uint8, device=x.device)
        all_gather_into_tensor(gathered, server_signs, group=self.group)
        server_scales = torch.empty(n, device=x.device)
        all_gather_into_tensor(server_scales, server_scale, group=self.group)
        result = unpack_signs(gathered).view(n, self.chunk).mul_(server_scales.view(n, 1))
        tensor.copy_(result.view(-1)[: self.numel].view_as(tensor))
        return tensor
