"""Ulysses and Ring Attention together on a 2-D sequence mesh (USP, Fang & Zhao 2024,
arXiv:2405.07719): all-to-all inside groups of `ulysses` ranks, the ring across them.

Ulysses alone is limited by the heads (its degree must divide them, and a kv head cannot
be split), the ring alone by its P sequential block steps. On a ulysses x ring mesh a rank
first trades heads for tokens inside its all-to-all group: it then holds h/u heads of the
u·s tokens of its group, which is one ring member's block of the sequence. The ring runs
over those blocks with h/u heads (each K/V message u times larger, r = P/u steps instead
of P), and a second all-to-all gives every rank its own tokens back with all heads.

The chunks a ring member holds are its group's chunks in group order, so the causal
skipping and load balancing of the ring carry over: with the balanced layout every rank's
chunk pairs sum to the same work.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from meshspeed.sequence.all_to_all import seq_all_to_all, seq_all_to_all_many
from meshspeed.sequence.layer import _replicate_kv
from meshspeed.sequence.ring import ring_attention


def hybrid_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ulysses_group: dist.ProcessGroup,
                     ring_group: dist.ProcessGroup, *, causal: bool = True, scale: float | None = None,
                     chunk_ids: list[tuple[int, ...]] | None = None) -> torch.Tensor:
    """q (b, h, s, d), k/v (b, h_kv, s, d): this rank's tokens with all heads; returns
    (b, h, s, d). `chunk_ids[j]`: the global chunks ring member j holds after the
    all-to-all (its all-to-all group's chunks, in group-rank order)."""
    # kv heads replicated up to the all-to-all degree when fewer (autograd sums the copies)
    k, v = _replicate_kv(q, k, v, 1, dist.get_world_size(ulysses_group))
    # heads scattered, tokens gathered: (b, h/u, u·s, d), the group's block of the sequence
    q, k, v = seq_all_to_all_many((q, k, v), ulysses_group, scatter_dim=1, gather_dim=2)
    out = ring_attention(q, k, v, ring_group, causal=causal, scale=scale, chunk_ids=chunk_ids)
    return seq_all_to_all(out, ulysses_group, scatter_dim=2, gather_dim=1)
