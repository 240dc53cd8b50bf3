"""Compressed gradient buckets for data parallelism: top-k and INT8/INT4, with error feedback.

A codec turns a flat fp32 bucket of n elements into one uint8 payload of a fixed size
(`payload_bytes`, the same on every rank), so a bucket is exchanged by ONE all-gather
of the payloads (or in two hops, Note [two hops]); every rank then decodes all of them in
rank order and sums, so every rank reconstructs the same sum (Note [the same sum on every
rank]).

    topk   k = ceil(ratio * n) entries: k int32 indices then k fp32 values      8k bytes
    int8   ceil(n / c) fp32 scales, then n int8 values                4 ceil(n/c) + n
    int4   ceil(n / c) fp32 scales, then ceil(n / 2) bytes of nibbles 4 ceil(n/c) + ceil(n/2)

(each rounded up to a multiple of 4 bytes so that the next rank's payload in the gathered
buffer starts aligned for its int32/fp32 part). c is `chunk`, the elements sharing one
symmetric max-abs scale: int8 values are round(x / s) with s = max|x| / 127, int4 values
round(x / s) with s = max|x| / 7, stored as x/s + 8 in a nibble, element 2i in the low
nibble of byte i and element 2i+1 in the high one.

Error feedback (Seide et al. 2014; Karimireddy et al. 2019, "Error Feedback Fixes
SignSGD"): each rank sends C(g + e) and keeps e' = g + e - D(C(g + e)), what compression
lost, for the next step; over steps the sum of what was sent plus the last residual is
the sum of the gradients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from meshspeed import comm


@dataclass(frozen=True)
class GradCompression:
    """How data parallelism compresses each bucket (from the `gradient_compression` block)."""

    method: str  # "topk", "int8" or "int4"
    ratio: float = 0.01  # topk: fraction of each bucket's elements sent
    chunk: int = 256  # int8/int4: elements per scale
    error_feedback: bool = True
    warmup_steps: int = 0  # optimizer steps reduced uncompressed first
    two_hop: bool = False  # int8/int4: Note [two hops], instead of one all-gather

    def codec(self, numel: int) -> Codec:
        if self.method == "topk":
            return TopK(numel, self.ratio)
        if self.method in ("int8", "int4"):
            return Quantized(numel, bits=int(self.method[3:]), chunk=self.chunk)
        raise ValueError(f"unknown gradient compression method {self.method!r}")


def _aligned(nbytes: int) -> int:
    return (nbytes + 3) // 4 * 4


class Codec:
    """Encodes a flat fp32 tensor of `numel` elements into `payload_bytes` uint8."""

    numel: int
    payload_bytes: int

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def add_decoded_(self, out: torch.Tensor, payload: torch.Tensor) -> torch.Tensor:
        """out += the values `payload` encodes (out is fp32 of `numel` elements)."""
        raise NotImplementedError

    def decode(self, payload: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(self.numel, dtype=torch.float32, device=payload.device)
        return self.add_decoded_(out, payload)


class TopK(Codec):
    """The k largest magnitudes: indices (int32) then values (fp32)."""

    def __init__(self, numel: int, ratio: float):
        if numel >= 2**31:
            raise ValueError(f"a top-k bucket holds at most 2**31 - 1 elements (int32 indices), got {numel}")
        self.numel = numel
        self.k = min(numel, max(1, math.ceil(ratio * numel)))
        self.payload_bytes = 8 * self.k

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        idx = torch.topk(x.abs(), self.k, sorted=False).indices
        idx = idx.sort().values  # a canonical order: decoding does not depend on topk's
        payload = torch.empty(self.payload_bytes, dtype=torch.uint8, device=x.device)
        payload[: 4 * self.k].view(torch.int32).copy_(idx)
        payload[4 * self.k :].view(torch.float32).copy_(x[idx])
        return payload

    def add_decoded_(self, out: torch.Tensor, payload: torch.Tensor) -> torch.Tensor:
        idx = payload[: 4 * self.k].view(torch.int32).long()
        values = payload[4 * self.k :].view(torch.float32)
        # indices of one payload are distinct: no two atomic adds meet (same sum on GPU)
        return out.index_add_(0, idx, values)


class Quantized(Codec):
    """Symmetric per-chunk INT8 / INT4: fp32 scales, then the packed integers."""

    def __init__(self, numel: int, bits: int, chunk: int):
        if bits not in (8, 4):
            raise ValueError(f"bits must be 8 or 4, got {bits}")
        if bits == 4 and chunk % 2:
            raise ValueError(f"int4 needs an even chunk, got {chunk}")
        self.numel, self.bits, self.chunk = numel, bits, chunk
        self.qmax = 127 if bits == 8 else 7
        self.chunks = math.ceil(numel / chunk)
        self.padded = self.chunks * chunk
        self.value_bytes = numel if bits == 8 else (numel + 1) // 2
        self.payload_bytes = _aligned(4 * self.chunks + self.value_bytes)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        blocks = torch.zeros(self.padded, dtype=torch.float32, device=x.device)
        blocks[: self.numel] = x
        blocks = blocks.view(self.chunks, self.chunk)
        scales = blocks.abs().amax(dim=1) / self.qmax  # (chunks,)
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        q = torch.round(blocks / safe[:, None]).clamp_(-self.qmax, self.qmax).view(-1)[: self.numel]
        payload = torch.zeros(self.payload_bytes, dtype=torch.uint8, device=x.device)
        payload[: 4 * self.chunks].view(torch.float32).copy_(scales)
        values = payload[4 * self.chunks : 4 * self.chunks + self.value_bytes]
        if self.bits == 8:
            values.view(torch.int8).copy_(q.to(torch.int8))
        else:
            nibbles = (q + 8).to(torch.uint8)  # 1..15
            if self.numel % 2:
                nibbles = torch.cat([nibbles, nibbles.new_full((1,), 8)])
            pairs = nibbles.view(-1, 2)
            values.copy_(pairs[:, 0] | (pairs[:, 1] << 4))
        return payload

    def add_decoded_(self, out: torch.Tensor, payload: torch.Tensor) -> torch.Tensor:
        scales = payload[: 4 * self.chunks].view(torch.float32)
        values = payload[4 * self.chunks : 4 * self.chunks + self.value_bytes]
        if self.bits == 8:
            q = values.view(torch.int8).float()
        else:
            q = torch.stack([values & 0xF, values >> 4], dim=1).view(-1)[: self.numel].float() - 8
        return out.add_(q * scales.repeat_interleave(self.chunk)[: self.numel])


# Note [the same sum on every rank]
# Every rank decodes the gathered payloads of all ranks, its own included (not its exact
# gradient), and adds them into a zeroed buffer one rank after the other, in rank order:
# the same inputs and the same sequence of floating-point additions on every rank, hence
# bitwise-equal averaged gradients and parameters that stay identical without a
# broadcast. Within one payload top-k indices are distinct, so index_add_ has no
# colliding (order-dependent) atomic adds on a GPU.


def compressed_bucket(policy: GradCompression, numel: int, device: torch.device, group):
    """One bucket's exchange: `launch(grad, async_op)` from the hook, `sum_into(out)` at the step."""
    return (TwoHopBucket if policy.two_hop else CompressedBucket)(policy, numel, device, group)


class CompressedBucket:
    """One bucket's compressed exchange and its error-feedback residual (fp32, this rank's)."""

    def __init__(self, policy: GradCompression, numel: int, device: torch.device, group):
        self.codec = policy.codec(numel)
        self.group = group
        self.world = comm.get_world_size(group)
        self.residual = torch.zeros(numel, dtype=torch.float32, device=device) if policy.error_feedback else None
        self.gathered: torch.Tensor | None = None

    def buffers(self) -> list[torch.Tensor]:
        """What stays resident between steps (memory report: comm_buffers)."""
        return [] if self.residual is None else [self.residual]

    def launch(self, grad: torch.Tensor, async_op: bool):
        """Compress grad (+ residual), update the residual, start the all-gather."""
        x = grad.float()
        if self.residual is not None:
            x = x + self.residual
        payload = self.codec.encode(x)
        if self.residual is not None:
            torch.sub(x, self.codec.decode(payload), out=self.residual)
            # a non-finite gradient (a step check_finite skips) must not live on in the residual
            self.residual.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        self.gathered = torch.empty(self.world * self.codec.payload_bytes, dtype=torch.uint8, device=grad.device)
        return comm.all_gather_into_tensor(self.gathered, payload, group=self.group, async_op=async_op)

    def sum_into(self, out: torch.Tensor) -> None:
        """out = the sum over ranks of the decoded payloads (Note [the same sum on every rank])."""
        total = torch.zeros(self.codec.numel, dtype=torch.float32, device=out.device)
        for payload in self.gathered.view(self.world, self.codec.payload_bytes):
            self.codec.add_decoded_(total, payload)
        out.copy_(total)
        self.gathered = None


# Note [two hops]
# An all-gather of whole payloads moves (N-1) x payload per rank: more than the fp32
# all-reduce's 2(N-1)/N x 4n once N > 8 for int8. Two hops keep the all-reduce's factor,
# as a reduce-scatter then an all-gather would (the compressed all-reduce of 1-bit Adam,
# Tang et al. 2021, and of ZeRO++'s qgZ): the bucket, padded to N shards of s elements
# (s a multiple of the chunk), is quantized shard by shard; an all-to-all (from the hook)
# gives rank r every rank's shard r; at the step rank r sums their decoded values in rank
# order, adds its own second residual, quantizes the sum again and all-gathers it; every
# rank decodes the N summed shards. Per rank: 2 (N-1) x payload(s) bytes, about
# 2(N-1)/N x payload(n). The second hop is a synchronous collective at the step (every
# rank reaches it in bucket order from `prepare_step`); its error feedback is the shard
# owner's second residual, so the sum over steps is conserved on both hops.


class TwoHopBucket:
    """One bucket exchanged in two quantized hops (Note [two hops])."""

    def __init__(self, policy: GradCompression, numel: int, device: torch.device, group):
        self.group = group
        self.world = comm.get_world_size(group)
        self.numel = numel
        self.shard = math.ceil(math.ceil(numel / self.world) / policy.chunk) * policy.chunk
        self.codec = policy.codec(self.shard)
        feedback = policy.error_feedback
        self.residual = torch.zeros(numel, dtype=torch.float32, device=device) if feedback else None
        self.shard_residual = torch.zeros(self.shard, dtype=torch.float32, device=device) if feedback else None
        self.gathered: torch.Tensor | None = None  # this rank's shard from every rank, once sent

    def buffers(self) -> list[torch.Tensor]:
        return [t for t in (self.residual, self.shard_residual) if t is not None]

    def launch(self, grad: torch.Tensor, async_op: bool):
        x = torch.zeros(self.world * self.shard, dtype=torch.float32, device=grad.device)
        x[: self.numel] = grad
        if self.residual is not None:
            x[: self.numel] += self.residual
        shards = x.view(self.world, self.shard)
        payloads = torch.stack([self.codec.encode(part) for part in shards])  # (N, payload)
        if self.residual is not None:
            sent = torch.cat([self.codec.decode(p) for p in payloads])[: self.numel]
            torch.sub(x[: self.numel], sent, out=self.residual)
            self.residual.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        self.gathered = torch.empty_like(payloads).view(-1)
        return comm.all_to_all_single(self.gathered, payloads.view(-1), group=self.group, async_op=async_op)

    def sum_into(self, out: torch.Tensor) -> None:
        size = self.codec.payload_bytes
        mine = torch.zeros(self.shard, dtype=torch.float32, device=out.device)
        for payload in self.gathered.view(self.world, size):  # rank order
            self.codec.add_decoded_(mine, payload)
        if self.shard_residual is not None:
            mine += self.shard_residual
        payload = self.codec.encode(mine)
        if self.shard_residual is not None:
            torch.sub(mine, self.codec.decode(payload), out=self.shard_residual)
            self.shard_residual.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        summed = torch.empty(self.world * size, dtype=torch.uint8, device=out.device)
        comm.all_gather_into_tensor(summed, payload, group=self.group)
        total = torch.cat([self.codec.decode(p) for p in summed.view(self.world, size)])
        out.copy_(total[: self.numel])
        self.gathered = None
