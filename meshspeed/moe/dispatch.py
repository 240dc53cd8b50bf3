"""Moving each token to its experts and back, over the expert-parallel group.

    out = exchange_capacity(routing, x, experts, group)   # drop_tokens=True: padded buffers
    out = exchange_dropless(routing, x, experts, group)   # drop_tokens=False: exact tokens

`routing` is a `gating.Routing` of this rank's S tokens x [S, M] over all E experts;
`experts` runs this rank's E / ep local experts (`Experts`: one [T_i, M] tensor per local
expert in, one out); `group` is the expert-parallel group (None: every expert is local).
Both return the gate-weighted mix of each token's experts, [S, M], differentiable in x,
in the routing weights and in the experts' parameters. Expert placement: rank r of the
group (its rank within the group) holds experts [r * E / ep, (r + 1) * E / ep).

The all-to-alls are `meshspeed.comm.differentiable.all_to_all` (backward: the same
exchange, split sizes swapped), shared with sequence parallelism.

Note [capacity exchange]
GShard's dispatch (arXiv:2006.16668, Algorithm 2; DeepSpeed's MOELayer): the buffer
[E, C, M] (`Routing.dispatch`, zero rows where an expert has fewer than C tokens) is cut
along experts into ep blocks of E/ep experts, block j going to rank j. After the
all-to-all, rank r holds block r of every rank: [ep, E/ep, C, M], source rank first. Local
expert l runs once on its ep * C rows; the outputs go back by the same all-to-all and
`Routing.combine` mixes them. Per layer and rank: 2 all-to-alls forward, 2 backward (an
equal-split all-to-all is its own adjoint), each of E * C * M elements, of which
(ep - 1) / ep leave the rank. Every rank of the group must hold the same C: the layer pads
the routings to the group's largest (Note [one capacity over the ep group] in layer.py).

Note [dropless exchange]
No padding: rank r sends exactly its kept (token, choice) pairs. They are laid out sorted
by expert, which is also by destination rank, using the Routing invariant that kept
slots of an expert are 0, 1, 2, ... without gaps: the row of a choice is
offset[expert] + slot, a permutation computed without sorting. Three all-to-alls forward:
(1) the [E] per-expert counts, so that rank r learns counts[j, e] for its local e from
every j (E int64 per rank); (2) the tokens, with those counts as split sizes; (3) the
expert outputs back with the splits reversed. The backward runs the reverse of (3) and
of (2) (a variable all-to-all's adjoint swaps its split sizes), and needs no counts.
Received rows are ordered (source rank, local expert); a stable argsort of the local
expert of each row groups them by expert (skipped with one local expert). One host sync
per forward, for the counts. A rank with no tokens, an expert with no tokens, any mix of
token counts: every rank issues the same collectives, empty splits included, and every
expert runs (on zero rows if need be) so that its parameters get a gradient, zero or not,
on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from meshspeed import comm
from meshspeed.comm import differentiable
from meshspeed.moe.gating import Routing

__all__ = ["BufferAllToAll", "all_to_all", "all_to_all_uneven", "exchange_capacity", "exchange_dropless"]

RunExperts = Callable[[Sequence[torch.Tensor]], Sequence[torch.Tensor]]


# -- differentiable all-to-alls -----------------------------------------------------------------


def all_to_all(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Dim-0 block j of x goes to rank j; block r of the result came from rank r (equal
    blocks). Backward: the same all-to-all of the gradient."""
    return differentiable.all_to_all(x, group)


def all_to_all_uneven(x: torch.Tensor, group: Any, output_splits: Sequence[int],
                      input_splits: Sequence[int]) -> torch.Tensor:
    """The first input_splits[0] rows of x go to rank 0, the next input_splits[1] to rank 1,
    ...; the result holds output_splits[j] rows from each rank j, in rank order. Backward:
    the all-to-all of the gradient with the splits swapped."""
    return differentiable.all_to_all(x, group, output_splits, input_splits)


# Note [the buffer all-to-all, by attribute]
# The capacity exchange calls its two all-to-alls as `BufferAllToAll.apply(group, buffer)`,
# looked up on the class at each call, never bound once: DeepSpeed's MOELayer calls
# `sharded_moe._AllToAll.apply(group, x)` the same way, and scripts and tests replace that
# attribute (to count the exchanges, or to stub them on one process).
# `deepspeed.moe.sharded_moe._AllToAll` is this class, so a replacement there reaches
# meshspeed's layers too. The dropless exchange sends uneven splits, which DeepSpeed's
# _AllToAll cannot express, and is not routed through it.


class BufferAllToAll:
    """The equal-block all-to-all of the capacity buffers, with autograd (`all_to_all`),
    called as DeepSpeed's `_AllToAll` is: `BufferAllToAll.apply(group, x)`, Note [the
    buffer all-to-all, by attribute]."""

    @staticmethod
    def apply(group: Any, x: torch.Tensor) -> torch.Tensor:
        return all_to_all(x, group)


# -- the exchanges ------------------------------------------------------------------------------


def _ep_size(group: Any, num_experts: int) -> int:
    ep = 1 if group is None else comm.get_world_size(group)
    if num_experts % ep:
        raise ValueError(f"{num_experts} experts cannot be split over an expert-parallel group of "
                         f"{ep} ranks; use a group whose size divides the number of experts.")
    return ep


def _per_rank(counts: list[int], ep: int) -> list[int]:
    """Per-expert counts [ep * local], rank-major -> rows per rank [ep]."""
    local = len(counts) // ep
    return [sum(counts[j * local:(j + 1) * local]) for j in range(ep)]


def exchange_capacity(routing: Routing, x: torch.Tensor, experts: RunExperts,
                      group: Any = None) -> torch.Tensor:
    """x [S, M] -> [S, M] through capacity-padded buffers, Note [capacity exchange]."""
    num_experts, cap, model_dim = routing.num_experts, routing.capacity, x.shape[1]
    ep = _ep_size(group, num_experts)
    local = num_experts // ep
    buffer = routing.dispatch(x)  # [E, C, M]
    if ep > 1:
        buffer = BufferAllToAll.apply(group, buffer)  # [ep * local, C, M]: block j from rank j
    # [ep, local, C, M] -> local expert i's [ep * C, M] rows: one copy (none if ep or local
    # is 1), and unbind's backward one stack, where an index per expert would zero-fill a
    # whole [E, C, M] gradient for each of the local experts.
    per_expert = buffer.view(ep, local, cap, model_dim).transpose(0, 1).reshape(local, ep * cap, model_dim)
    outs = experts(per_expert.unbind(0))
    if local == 1:
        out = outs[0].view(num_experts, cap, model_dim)
    else:
        out = torch.stack([o.view(ep, cap, model_dim) for o in outs], 1).view(num_experts, cap, model_dim)
    if ep > 1:
        out = BufferAllToAll.apply(group, out)  # back to [E, C, M] in this rank's token slots
    return routing.combine(out)


def exchange_dropless(routing: Routing, x: torch.Tensor, experts: RunExperts,
                      group: Any = None) -> torch.Tensor:
    """x [S, M] -> [S, M] sending exactly the kept choices, Note [dropless exchange]."""
    num_experts, (num_tokens, k), model_dim = routing.num_experts, routing.slot.shape, x.shape[1]
    ep = _ep_size(group, num_experts)
    local = num_experts // ep
    expert = routing.expert_index.reshape(-1)  # [S*k], row s*k + j: token s's j-th choice
    kept = routing.kept.reshape(-1)
    send_counts = torch.zeros(num_experts, dtype=torch.long, device=x.device).index_add_(
        0, expert, kept.long())  # [E]
    if ep > 1:
        recv_counts = torch.empty_like(send_counts)  # [ep * local]: (source rank, local expert)
        comm.all_to_all_single(recv_counts, send_counts, group=group)
        counts = torch.cat([send_counts, recv_counts]).tolist()  # the one host sync
        send_host, recv_host = counts[:num_experts], counts[num_experts:]
    else:
        send_host = recv_host = send_counts.tolist()
    sent = sum(send_host)

    # Row of each kept choice in the expert-sorted send buffer; dropped choices point at
    # row `sent`, past the end (a zero row in the combine below, never sent).
    offsets = send_counts.cumsum(0) - send_counts
    row = torch.where(kept, offsets[expert] + routing.slot.reshape(-1), sent)
    token_of_row = torch.zeros(sent + 1, dtype=torch.long, device=x.device).index_copy_(
        0, row, torch.arange(num_tokens * k, device=x.device) // k)
    send = x.index_select(0, token_of_row[:sent])  # [sent, M]

    splits_out, splits_in = _per_rank(send_host, ep), _per_rank(recv_host, ep)
    received = send if ep == 1 else all_to_all_uneven(send, group, splits_in, splits_out)
    sizes = [sum(recv_host[j * local + i] for j in range(ep)) for i in range(local)]
    order = None
    if ep > 1 and local > 1:  # (source rank, local expert) order -> local expert order
        rows = received.shape[0]
        expert_of_row = torch.arange(local, device=x.device).repeat(ep).repeat_interleave(
            recv_counts, output_size=rows)
        order = torch.argsort(expert_of_row, stable=True)
        received = received.index_select(0, order)
    outs = experts(list(received.split(sizes)))
    out = outs[0] if local == 1 else torch.cat(list(outs))
    if order is not None:
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=x.device)
        out = out.index_select(0, inverse)
    back = out if ep == 1 else all_to_all_uneven(out, group, splits_out, splits_in)  # [sent, M]

    padded = torch.cat([back, back.new_zeros(1, model_dim)])
    routed = padded.index_select(0, row).view(num_tokens, k, model_dim)
    return (routed * routing.weight.unsqueeze(-1)).sum(1).to(back.dtype)
