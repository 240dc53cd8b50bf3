"""Ring Attention (Liu, Zaharia, Abbeel, arXiv:2310.01889): exact attention over a sequence
split across the members of a process group, K/V blocks passed around the ring.

    out = ring_attention(q, k, v, group, causal=True)                 # contiguous chunks
    layout = SequenceLayout(seq_len, degree=n, balanced=True)
    out = ring_attention(q, k, v, group, chunk_ids=[layout.chunks(j) for j in range(n)])

q [b, h_q, s_local, d], k and v [b, h_kv, s_local, d] (SDPA layout, h_kv dividing h_q):
this member's tokens, which are the global chunks `chunk_ids[rank]` in that order, all of
length s_local / len(chunk_ids[rank]). The output has q's shape and dtype. The kernel of
one block pair is block_attention.py.

Note [ring schedule]
Member r of n sends to r + 1 and receives from r - 1 (mod n, ranks within the group).
Step t = 0 .. n-1 works on the K/V block owned by member r - t: q never moves, K and V
(packed into one buffer) move one hop per step.

Forward. At the start of step t < n-1 two transfers are posted: the block held now goes
to r + 1 and the block of step t + 1 comes from r - 1. Then the block held now is
computed, then both transfers are waited on: each hop is in flight during one block's
compute. Partial outputs merge by log-sum-exp (block_attention.merge). n - 1 hops of
K/V per member.

Backward. The same K/V hops, posted at the same moments. Each block also carries its
owner's gradient accumulator dK/dV, in the accumulation dtype (Note [block attention
precision]). At step t this member computes its share of the block's dK/dV into a fresh
buffer while the accumulator filled by member r - 1 at its step t - 1 is still in
flight; then it waits for that accumulator, adds its share and sends the sum to r + 1.
After step n - 1 all n members have added to a block's accumulator, which then sits on
member owner - 1; that last send, dK/dV only, is the hop back to the owner. So n - 1 hops
of K/V and n hops of dK/dV per member. dQ never moves: it accumulates locally.

Memory. Saved for backward are this member's q, k, v, out and lse (float32; float64 for
float64 inputs), nothing from other members: the backward fetches the K/V blocks again
rather than keeping the n blocks the forward saw. At any moment at most two K/V blocks
(the one computed, the one arriving) and three dK/dV buffers (the share being computed,
the one arriving, the one leaving) are alive, whatever n is.
tests/sequence/test_ring.py asserts the saved bytes at n = 2 and 4.

Causality is by global chunk index: the pair (query chunk a, key chunk c) is skipped when
c > a, masked lower-triangular when c == a, full when c < a. A block none of whose pairs
is visible is not computed at all; its accumulator passes through unchanged.

Messages. Within one call each message has its own tag (step and kind), and the two ends
of a hop issue their halves in the same order, so gloo pairs them unambiguously. Even
members post the send first, odd members the receive: on a transport that pairs in issue
order per pair of ranks (NCCL point-to-point at n = 2, where next and previous are the
same member) a send then always meets a posted receive. NCCL is untested here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.function import once_differentiable
from typing_extensions import Self

from meshspeed import comm
from meshspeed.sequence.block_attention import (
    accumulation_dtype,
    block_backward,
    block_forward,
    compute_delta,
    merge,
)

_KINDS = ("full", "diagonal", "skipped")


class BlockCounter:
    """Chunk pairs this rank's ring attention handled while active, per pass and kind.

        with BlockCounter() as blocks:
            ring_attention(...).backward(...)
        blocks.forward == {"full": 3, "diagonal": 1, "skipped": 0}

    A pair is one (query chunk, key chunk) of the causal mask at chunk granularity:
    "full" (key chunk before the query chunk, or any pair without a causal mask),
    "diagonal" (the same chunk, masked lower-triangular), "skipped" (hidden, not computed).
    """

    def __init__(self) -> None:
        self.forward = dict.fromkeys(_KINDS, 0)
        self.backward = dict.fromkeys(_KINDS, 0)

    def __enter__(self) -> Self:
        _counters.append(self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        _counters[:] = [c for c in _counters if c is not self]


_counters: list[BlockCounter] = []


def _count(phase: str, counts: dict[str, int]) -> None:
    for counter in _counters:
        tally = getattr(counter, phase)
        for kind, n in counts.items():
            tally[kind] += n


# -- which pairs of one step are computed --------------------------------------------------------


@dataclass(frozen=True)
class _Call:
    q_chunk: int | None  # position of the query chunk in the local sequence; None: all of it
    kv_chunks: tuple[int, ...]  # positions of the key chunks in the K/V block
    causal_diag: bool


def _plan(q_ids: tuple[int, ...], kv_ids: tuple[int, ...],
          causal: bool) -> tuple[list[_Call], dict]:
    """The block_forward calls of local queries `q_ids` against a block of chunks `kv_ids`,
    and the pair counts by kind."""
    if not causal or max(kv_ids) < min(q_ids):  # every pair full: one call
        return [_Call(None, tuple(range(len(kv_ids))), False)], {
            "full": len(q_ids) * len(kv_ids), "diagonal": 0, "skipped": 0}
    calls, counts = [], dict.fromkeys(_KINDS, 0)
    for a, qa in enumerate(q_ids):
        full = tuple(j for j, c in enumerate(kv_ids) if c < qa)
        diag = tuple(j for j, c in enumerate(kv_ids) if c == qa)
        if full:
            calls.append(_Call(a, full, False))
        if diag:
            calls.append(_Call(a, diag, True))
        counts["full"] += len(full)
        counts["diagonal"] += len(diag)
        counts["skipped"] += len(kv_ids) - len(full) - len(diag)
    return calls, counts


def _chunks(x: torch.Tensor, positions: tuple[int, ...], chunk_len: int) -> torch.Tensor:
    """The chunks at `positions` of x's sequence dim (2), a view when they are adjacent."""
    if positions == tuple(range(positions[0], positions[0] + len(positions))):
        return x.narrow(2, positions[0] * chunk_len, len(positions) * chunk_len)
    return torch.cat([x.narrow(2, j * chunk_len, chunk_len) for j in positions], dim=2)


def _add_chunks(dst: torch.Tensor, positions: tuple[int, ...], chunk_len: int,
                src: torch.Tensor) -> None:
    """dst[chunks at `positions`] += src, the inverse of `_chunks`."""
    for i, j in enumerate(positions):
        dst.narrow(2, j * chunk_len, chunk_len).add_(src.narrow(2, i * chunk_len, chunk_len))


def _span(x: torch.Tensor, q_chunk: int | None, chunk_len: int) -> torch.Tensor:
    return x if q_chunk is None else x.narrow(2, q_chunk * chunk_len, chunk_len)


# -- the ring ------------------------------------------------------------------------------------


class _Shift:
    """One hop: this member's tensor to the next member, the previous member's into a new
    buffer; posted on construction, `wait()` returns the received tensor."""

    def __init__(self, ring: _Ring, tensor: torch.Tensor, tag: int) -> None:
        self.received = torch.empty_like(tensor)
        self._sent = tensor  # kept alive until the send completes
        self._works = []
        send_first = ring.rank % 2 == 0  # Note [ring schedule], messages
        for sending in (send_first, not send_first):
            if sending:
                self._works.append(comm.isend(tensor, ring.next, ring.group, tag))
            else:
                self._works.append(comm.irecv(self.received, ring.prev, ring.group, tag))

    def wait(self) -> torch.Tensor:
        for work in self._works:
            work.wait()
        self._sent = None
        return self.received


@dataclass(frozen=True)
class _Ring:
    group: Any
    rank: int
    size: int
    chunk_ids: tuple[tuple[int, ...], ...]  # per member, in group-rank order
    chunk_len: int
    causal: bool
    scale: float

    @property
    def next(self) -> int:
        return (self.rank + 1) % self.size

    @property
    def prev(self) -> int:
        return (self.rank - 1) % self.size

    def step_plan(self, t: int) -> tuple[list[_Call], dict]:
        """What step t computes: local queries against the block of member rank - t."""
        owner = (self.rank - t) % self.size
        return _plan(self.chunk_ids[self.rank], self.chunk_ids[owner], self.causal)

    def shift(self, tensor: torch.Tensor, t: int, kind: int) -> _Shift:
        return _Shift(self, tensor, 2 * t + kind)


_KV, _GRAD = 0, 1  # message kinds, part of the tag


def _forward(ring: _Ring, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    acc = accumulation_dtype(q.dtype)
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
    kv, c = torch.stack((k, v)), ring.chunk_len
    for t in range(ring.size):
        hop = ring.shift(kv, t, _KV) if t < ring.size - 1 else None
        calls, counts = ring.step_plan(t)
        _count("forward", counts)
        for call in calls:
            o, l = block_forward(_span(q, call.q_chunk, c), _chunks(kv[0], call.kv_chunks, c),
                                 _chunks(kv[1], call.kv_chunks, c), ring.scale, call.causal_diag)
            o_acc, l_acc = _span(out, call.q_chunk, c), _span(lse, call.q_chunk, c)
            merged, merged_lse = merge(o_acc, l_acc, o, l)
            o_acc.copy_(merged)
            l_acc.copy_(merged_lse)
        if hop is not None:
            kv = hop.wait()
    return out, lse


def _backward(ring: _Ring, dout, q, k, v, out, lse):
    acc = accumulation_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    delta = compute_delta(dout, out)
    kv, c = torch.stack((k, v)), ring.chunk_len
    grads: _Shift | None = None  # the accumulator of this step's block, in flight
    for t in range(ring.size):
        hop = ring.shift(kv, t, _KV) if t < ring.size - 1 else None
        calls, counts = ring.step_plan(t)
        _count("backward", counts)
        # A member always sees its own block (its diagonal), so share is None only at t > 0.
        share = torch.zeros(kv.shape, dtype=acc, device=kv.device) if calls else None
        for call in calls:
            do_, q_, out_, lse_, delta_, dq_acc = (
                _span(x, call.q_chunk, c) for x in (dout, q, out, lse, delta, dq))
            dq_, dk_, dv_ = block_backward(
                do_, q_, _chunks(kv[0], call.kv_chunks, c), _chunks(kv[1], call.kv_chunks, c),
                out_, lse_, delta_, ring.scale, call.causal_diag)
            dq_acc.add_(dq_)
            _add_chunks(share[0], call.kv_chunks, c, dk_)
            _add_chunks(share[1], call.kv_chunks, c, dv_)
        if grads is not None:  # Note [ring schedule]: waited after this step's compute
            share = grads.wait() if share is None else share.add_(grads.wait())
        if ring.size > 1:  # to the next member; after step n - 1 that is the block's owner
            grads = ring.shift(share, t, _GRAD)
        if hop is not None:
            kv = hop.wait()
    own = share if grads is None else grads.wait()  # this member's dK/dV, after a full turn
    return dq, own[0], own[1]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: _Ring):
        out, lse = _forward(ring, q, k, v)
        out = out.to(q.dtype)
        ctx.ring = ring
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(ctx.ring, dout.contiguous(), q, k, v, out, lse)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: Any,
    *,
    causal: bool = True,
    scale: float | None = None,
    chunk_ids: Sequence[Sequence[int]] | None = None,
) -> torch.Tensor:
    """Exact (optionally causal) attention of this member's queries over the keys and
    values of every member of `group` (Note [ring schedule]); differentiable.

    q [b, h_q, s_local, d]; k, v [b, h_kv, s_local, d] with h_kv dividing h_q. `scale`
    defaults to 1 / sqrt(d). `chunk_ids[j]`: the global chunk indices member j's local
    sequence holds, in order (SequenceLayout.chunks(j)); default: member j holds chunk j.
    Returns out [b, h_q, s_local, d] in q's dtype.
    """
    n, rank = comm.get_world_size(group), comm.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of the ring's group; call "
                         "ring_attention only on the ranks of `group`")
    ids = _check(q, k, v, n, chunk_ids)
    ring = _Ring(group, rank, n, ids, q.size(2) // len(ids[0]), causal,
                 1.0 / math.sqrt(q.size(-1)) if scale is None else float(scale))
    return _RingAttention.apply(q, k, v, ring)


def _check(q, k, v, n: int, chunk_ids) -> tuple[tuple[int, ...], ...]:
    """Raise ValueError naming the bad argument; the chunk ids as tuples."""
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4 or (q.size(0), q.size(2), q.size(3)) != (
            k.size(0), k.size(2), k.size(3)):
        raise ValueError(
            f"q, k, v must be [batch, heads, s_local, head_dim] with equal batch, s_local and "
            f"head_dim, and k and v of one shape; got q {tuple(q.shape)}, k {tuple(k.shape)}, "
            f"v {tuple(v.shape)}: pass them in SDPA layout (transpose(1, 2) from [b, s, h, d])")
    if q.dtype != k.dtype or q.dtype != v.dtype or q.device != k.device or q.device != v.device:
        raise ValueError(f"q, k, v must share dtype and device, got {q.dtype}/{q.device}, "
                         f"{k.dtype}/{k.device}, {v.dtype}/{v.device}; cast them to one")
    if q.size(1) % k.size(1):
        raise ValueError(f"{k.size(1)} key/value heads do not divide {q.size(1)} query heads; "
                         f"use a number of key/value heads that divides the query heads")
    ids = tuple((j,) for j in range(n)) if chunk_ids is None else tuple(
        tuple(int(c) for c in member) for member in chunk_ids)
    if len(ids) != n:
        raise ValueError(f"chunk_ids has {len(ids)} entries but the ring's group has {n} "
                         f"members; give one tuple of chunk indices per member, in rank order")
    counts = {len(member) for member in ids}
    if len(counts) != 1 or 0 in counts:
        raise ValueError(f"every member must hold the same, nonzero number of chunks, got "
                         f"chunk_ids {ids}; use a layout with equal chunks per member")
    flat = [c for member in ids for c in member]
    if len(set(flat)) != len(flat):
        raise ValueError(f"chunk_ids {ids} name a chunk more than once; each global chunk "
                         f"belongs to one member")
    if q.size(2) % len(ids[0]):
        raise ValueError(f"s_local = {q.size(2)} is not divisible by the {len(ids[0])} chunks "
                         f"each member holds; pad the sequence to a multiple of the chunk count")
    return ids
