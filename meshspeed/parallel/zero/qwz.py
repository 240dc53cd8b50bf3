"""ZeRO++ qwZ: stage-3 parameter all-gathers of block-quantized INT8 weights.

Wang et al., "ZeRO++: Extremely Efficient Collective Communication for Giant Model
Training" (arXiv:2306.10209), Section 3.1. Each rank encodes its shard of a unit into one
uint8 payload of a size every rank knows,

    [ ceil(S / B) fp32 scales | S int8 values ]       P = 4 ceil(S / B) + S bytes

(S = the unit's shard elements, B = `block` elements sharing one scale), the payloads
are all-gathered in ONE collective, and every rank decodes all N of them, its own
included, into the unit's flat buffer: every rank computes with the same working weights.
Per rank an all-gather then moves (N - 1) P bytes instead of (N - 1) S e (e = 2 bytes
in bf16/fp16, 4 in fp32): about half the bytes for 16-bit shards and a quarter for fp32.

Note [symmetric INT8 blocks]
Within a block of B consecutive shard elements, s = max|x| / 127 (fp32) and q =
round(x / s), clamped to [-127, 127]; the decoded value is q s, within s / 2 of x, and a
block's largest magnitude comes back exactly up to the rounding of s. An all-zero block
has s = 0 and decodes to zeros. DeepSpeed's CUDA quantizer (csrc/includes/
quantization_utils.h) uses s = max|x| / 128 with q clamped to [-128, 127], which clips
the block's largest positive value by one step; it casts bf16 input to fp16 first, and
picks the number of groups per shard adaptively (about 8000 elements each, dividing the
shard exactly). meshspeed uses fixed blocks (the last one short) of `BLOCK` elements,
computes in fp32, and writes the decoded values in the parameters' dtype.

Only the gathered working copy is quantized: shards, fp32 masters and optimizer state
stay in full precision, so each step's update is exact and quantization error does not
accumulate over steps (it perturbs the forward and backward of the step that uses it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

BLOCK = 2048  # elements per fp32 scale: 0.2% of the INT8 payload in scales
QMAX = 127


@dataclass(frozen=True)
class BlockQuantizer:
    """Encodes a shard of `numel` elements into `payload_bytes` uint8 and back."""

    numel: int
    block: int = BLOCK

    def __post_init__(self):
        if self.numel < 1 or self.block < 1:
            raise ValueError(f"numel and block must be positive, got {self.numel}, {self.block}")

    @property
    def blocks(self) -> int:
        return math.ceil(self.numel / self.block)

    @property
    def payload_bytes(self) -> int:
        return 4 * self.blocks + self.numel

    def scales(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 scale of every block of `x` (1-D, `numel` elements)."""
        x = x.float()
        full = self.numel // self.block * self.block
        parts = [x[:full].view(-1, self.block).abs().amax(dim=1)] if full else []
        if full < self.numel:
            parts.append(x[full:].abs().amax().view(1))
        return torch.cat(parts) / QMAX

    def _per_element(self, scales: torch.Tensor) -> torch.Tensor:
        return scales.repeat_interleave(self.block)[: self.numel]

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """The payload of `x`: scales then values (Note [symmetric INT8 blocks])."""
        if x.numel() != self.numel:
            raise ValueError(f"expected {self.numel} elements, got {x.numel()}")
        x = x.reshape(-1).float()
        scales = self.scales(x)
        step = self._per_element(torch.where(scales > 0, scales, torch.ones_like(scales)))
        q = torch.round(x / step).clamp_(-QMAX, QMAX).to(torch.int8)
        payload = torch.empty(self.payload_bytes, dtype=torch.uint8, device=x.device)
        payload[: 4 * self.blocks].view(torch.float32).copy_(scales)
        payload[4 * self.blocks :].view(torch.int8).copy_(q)
        return payload

    def decode_into(self, out: torch.Tensor, payload: torch.Tensor) -> torch.Tensor:
        """out (1-D, `numel` elements, any float dtype) <- the values `payload` encodes."""
        # the scales are copied out: a rank's payload inside a gathered buffer need not
        # start at a multiple of 4 bytes, which viewing them as fp32 would require
        scales = payload[: 4 * self.blocks].clone().view(torch.float32)
        q = payload[4 * self.blocks : self.payload_bytes].view(torch.int8)
        return out.copy_(q.float() * self._per_element(scales))

    def decode(self, payload: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        out = torch.empty(self.numel, dtype=dtype, device=payload.device)
        return self.decode_into(out, payload)

    def decode_gathered(self, out: torch.Tensor, gathered: torch.Tensor) -> None:
        """Every rank's payload in `gathered` (rank order) -> its range of `out` (the
        unit's flat buffer, `numel` elements per rank); one rank at a time, so the fp32
        temporaries are one shard's, not the unit's."""
        world = out.numel() // self.numel
        for r in range(world):
            self.decode_into(out[r * self.numel : (r + 1) * self.numel],
                             gathered[r * self.payload_bytes : (r + 1) * self.payload_bytes])
