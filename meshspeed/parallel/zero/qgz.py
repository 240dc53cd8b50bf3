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

Note [qgZ's two hops]
Across nodes that one all-to-all sends (N - L) P bytes per rank (L = the group's ranks per
node). The paper's qgZ runs it in two hops instead, and so does meshspeed when the group
spans several nodes (`nodes`: the ranks of one node and the ranks at the same place in
every node, from hpZ's partition when set, else from the launcher's ranks per node):
1. inside the node: with shard j = g L + l (node g, place l), rank (g, l) sends its local
   peer l' the G = N / L shards (·, l') encoded, and sums the L pieces it receives for
   its own place: the node's partial sum of the shards (g', l) for every node g';
2. across nodes, among the G ranks at place l: the partial of shard (g', l) is encoded
   again and sent to node g', and each rank sums the G pieces of its own shard.
Bytes per rank: (L - 1) G P inside the node and (G - 1) P across, against (N - L) P across
in one hop: L times fewer across nodes, the same in all. The partial sums are quantized
a second time (half a step of the partial's block per element more error, as in the
paper). Hop 2 starts when the unit's reduction is collected (`Pending.result`), not
overlapped with backward. With one node (L = N) or one rank per node there is one hop.

No error feedback: as in DeepSpeed's qgZ, what quantization loses in a step is dropped,
and the fp32 masters step on the dequantized sum (clipping and overflow checks see that
sum too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from meshspeed import comm
from meshspeed.parallel.data.compress import Quantized

GRAD_BLOCK = 256  # elements per fp32 scale (compress.py's default chunk)


@dataclass(frozen=True)
class NodeGroups:
    """The two hops' groups for one rank: `intra`, the shard group's ranks on this node
    (L of them), and `inter`, the ranks at the same place on every node (G of them)."""

    intra: Any
    inter: Any

    @property
    def per_node(self) -> int:
        return comm.get_world_size(self.intra)

    @property
    def nodes(self) -> int:
        return comm.get_world_size(self.inter)


class GradientExchange:
    """The qgZ exchange of one unit: `launch(full, group)` -> a `Pending` whose `result()`
    is this rank's fp32 summed shard."""

    def __init__(self, shard_numel: int, world: int, block: int = GRAD_BLOCK, nodes: NodeGroups | None = None):
        self.world = world
        self.shard_numel = shard_numel
        self.codec = Quantized(shard_numel, bits=4, chunk=block)
        if nodes is not None and nodes.per_node * nodes.nodes != world:
            raise ValueError(f"qgZ hops: {nodes.nodes} nodes of {nodes.per_node} ranks do not make the "
                             f"group of {world}")
        self.nodes = nodes if nodes is not None and 1 < nodes.per_node < world else None

    @property
    def payload_bytes(self) -> int:
        return self.codec.payload_bytes

    def _encode_all(self, pieces: torch.Tensor) -> torch.Tensor:
        """(k, S) fp32 or 16-bit -> (k, P) uint8 payloads."""
        out = torch.empty(pieces.shape[0], self.payload_bytes, dtype=torch.uint8, device=pieces.device)
        for j, piece in enumerate(pieces):
            out[j].copy_(self.codec.encode(piece))
        return out

    def _sum(self, payloads: torch.Tensor) -> torch.Tensor:
        """fp32 sum of the decoded payloads (k, P), in order."""
        out = torch.zeros(self.shard_numel, dtype=torch.float32, device=payloads.device)
        for piece in payloads:
            self.codec.add_decoded_(out, piece)
        return out

    def launch(self, full: torch.Tensor, group) -> Pending:
        """Encode the `world` shards of `full` (world * shard_numel elements) and start the
        (first) all-to-all."""
        if self.nodes is None:
            send = self._encode_all(full.view(self.world, self.shard_numel))
            recv = torch.empty_like(send)
            work = comm.all_to_all_single(recv.view(-1), send.view(-1), group=group, async_op=True)
            return Pending(self, recv, send, work, hop2=None)
        per_node, nodes = self.nodes.per_node, self.nodes.nodes
        # shard g L + l goes to place l: (G, L, S) -> (L, G, S), one block of G per peer
        by_place = full.view(nodes, per_node, self.shard_numel).transpose(0, 1)
        send = self._encode_all(by_place.reshape(-1, self.shard_numel)).view(per_node, nodes, -1)
        recv = torch.empty_like(send)
        work = comm.all_to_all_single(recv.view(-1), send.view(-1), group=self.nodes.intra, async_op=True)
        return Pending(self, recv, send, work, hop2=self.nodes.inter)

    def summed(self, recv: torch.Tensor) -> torch.Tensor:
        """fp32 sum of the pieces of this rank's shard, in rank order (the same additions
        on every rank for a given set of payloads)."""
        return self._sum(recv)


class Pending:
    """An exchange in flight: `result()` waits, runs the second hop if any, and returns
    this rank's fp32 sum."""

    def __init__(self, exchange: GradientExchange, recv, send, work, hop2):
        self.exchange, self.recv, self.send, self.work, self.hop2 = exchange, recv, send, work, hop2

    def result(self) -> torch.Tensor:
        self.work.wait()
        self.send = None  # sent: its memory may be reused
        ex = self.exchange
        if self.hop2 is None:
            return ex._sum(self.recv)
        # hop 1 landed: recv[l', g] is peer l''s piece of shard (g, my place)
        partial = torch.stack([ex._sum(self.recv[:, g]) for g in range(self.recv.shape[1])])
        send = ex._encode_all(partial)
        recv = torch.empty_like(send)
        comm.all_to_all_single(recv.view(-1), send.view(-1), group=self.hop2)
        return ex._sum(recv)
