"""ZeRO++ qgZ: a unit's gradient reduce-scatter as one all-to-all of INT4 payloads.

Wang et al., "ZeRO++" (arXiv:2306.10209), Section 3.3. Instead of reduce-scattering the
unit's full gradient (n = N S elements, S = the shard), each rank cuts it into its N
shards, encodes every shard with the INT4 codec of data-parallel compression
(`meshspeed.parallel.data.compress.Quantized`, bits 4: per block of `GRAD_BLOCK`
elements one fp32 scale s = max|x| / 7, values round(x / s) in [-7, 7], two per byte),

    P = align4(4 ceil(S / B) + ceil(S / 2)) bytes per shard,

and sends shard j to rank j in ONE `all_to_all_single` of uint8. Rank r then decodes the
N pieces of its own shard, its own piece included, and sums them in fp32 in rank order;
the average (divide by the group's divisor) is taken as on the plain path. Per rank the
exchange moves (N - 1) P = (N-1)/N * N P bytes against (N-1)/N * n e for the plain
reduce-scatter (e = 2 bytes in bf16, 4 in fp32): about a quarter of bf16's bytes and an
eighth of fp32's (the scales add 4 / B bytes per element, 1.6% of the INT4 payload at
B = 256).

The paper's qgZ runs two hops, an all-to-all inside a node, a reduction, then an
all-to-all across nodes, so that inter-node traffic shrinks by the node size. With one
node there is only the first hop; meshspeed builds that one hop (no hierarchical
version). No error feedback: as in DeepSpeed's qgZ, what quantization loses in a step is
dropped, and the fp32 masters step on the dequantized sum (clipping and overflow checks
see that sum too).
"""

from __future__ import annotations

import torch

from meshspeed import comm
from meshspeed.parallel.data.compress import Quantized

GRAD_BLOCK = 256  # elements per fp32 scale (compress.py's default chunk)


class GradientExchange:
    """The qgZ exchange of one unit: `launch(full, group)`, then `summed()` once it is done."""

    def __init__(self, shard_numel: int, world: int, block: int = GRAD_BLOCK):
        self.world = world
        self.shard_numel = shard_numel
        self.codec = Quantized(shard_numel, bits=4, chunk=block)

    @property
    def payload_bytes(self) -> int:
        return self.codec.payload_bytes

    def launch(self, full: torch.Tensor, group):
        """Encode each of the `world` shards of `full` (world * shard_numel elements) and
        start the all-to-all; returns (received payloads, sent payloads, work handle): the
        caller holds the sent ones until the work is waited on."""
        shards = full.view(self.world, self.shard_numel)
        send = torch.empty(self.world, self.payload_bytes, dtype=torch.uint8, device=full.device)
        for j in range(self.world):
            send[j].copy_(self.codec.encode(shards[j]))
        recv = torch.empty_like(send)
        work = comm.all_to_all_single(recv.view(-1), send.view(-1), group=group, async_op=True)
        return recv, send, work

    def summed(self, recv: torch.Tensor) -> torch.Tensor:
        """fp32 sum of the pieces of this rank's shard, in rank order (the same additions
        on every rank for a given set of payloads)."""
        out = torch.zeros(self.shard_numel, dtype=torch.float32, device=recv.device)
        for piece in recv:
            self.codec.add_decoded_(out, piece)
        return out
