"""Mixture-of-Experts gating: which expert each token goes to, and in which slot.

The router of GShard (arXiv:2006.16668, top-2), Switch (arXiv:2101.03961, top-1) and
DeepSpeed-MoE (arXiv:2201.05596), with DeepSpeed's semantics (`deepspeed/moe/sharded_moe.py`)
where DeepSpeed defines them, as pure functions of the router logits on one process:

    routing = top1_routing(logits, capacity_factor=1.0, min_capacity=4)   # or top2_routing,
                                                                          # topk_routing(logits, k)
    buffer = routing.dispatch(x)          # [E, C, M]: each expert's tokens, zero-padded
    y = routing.combine(experts(buffer))  # [S, M]: gate-weighted sum of each token's experts
    loss = loss + aux_coef * routing.l_aux + z_coef * routing.z_loss

`Gate` is the module around them (DeepSpeed's `TopKGate`): the `wg` projection in fp32,
input jitter, and the train/eval capacity factor. The only communication is the optional
MAX all-reduce of the dropless capacity over `capacity_group` (Note [dropless capacity]).

A routing is kept in index form (`Routing`): per (token, choice) the expert, the slot in
that expert's buffer (-1 when the token is dropped) and the gate weight; O(S*k), not
DeepSpeed's O(S*E*C) one-hot tensors, which `Routing.dense()` still builds on request.

Note [random numbers in gating]
Every random draw uses torch's default generator for the logits' device, or `generator`
when one is passed, and is float32. Per call, in this order, and nothing else:
  a. `Gate` in training with noisy_gate_policy="Jitter": `torch.rand(x.shape)` for the
     multiplicative jitter of the router input (`jitter`). Then, for k=1:
  b1. in training with noisy_gate_policy="RSample": `torch.rand(S, E)` turned into
      Gumbel(0, 1) noise added to the logits to pick the expert (`gumbel_noise`);
  c1. with use_rts=True (training and eval, dropless too): `torch.rand(S, E)`, the
      random-token-selection priorities (row s, column e: token s's priority at expert e).
  or, for k=2:
  b2. with top2_2nd_expert_sampling=True (training and eval): `torch.rand(S, E)` turned
      into Gumbel noise added to the logits to pick the second expert.
  (k >= 3, `topk_routing`, draws nothing.)
These are the draws DeepSpeed 0.19 makes, of the same shapes, in the same order, with the
same transforms, so one seed gives the same routing here and in DeepSpeed, and the same
generator state afterwards (dropout after the gate sees the same numbers). A one-process
reference that calls the gate on the same tokens with the same seed reproduces it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from meshspeed import comm

__all__ = [
    "NOISY_GATE_POLICIES",
    "Gate",
    "Routing",
    "capacity",
    "gumbel_noise",
    "jitter",
    "top1_routing",
    "top2_routing",
    "topk_routing",
]

logger = logging.getLogger("meshspeed")

NOISY_GATE_POLICIES = (None, "None", "Jitter", "RSample")  # "None" is DeepSpeed's string for None
DROP_POLICIES = ("probs", "position")  # topk_routing: which tokens an over-full expert keeps


# -- capacity -----------------------------------------------------------------------------------

# Note [capacity in float32]
# DeepSpeed computes ceil(S / E * capacity_factor) with the factor as a float32 tensor, so
# the factor and the product are rounded to float32 before the ceil: 25 tokens, 2 experts,
# factor 1.2 give 16 (float32 15.0000006), not 15. We round the same way, so that buffer
# shapes, and so which tokens are dropped, agree with DeepSpeed's.


def capacity(num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: int = 0,
             *, k: int = 1) -> int:
    """Slots per expert: ceil(num_tokens / num_experts * capacity_factor * k), at least
    `min_capacity` (top-2 passes k=2: each token fills two slots). Rounded as DeepSpeed
    does, Note [capacity in float32]."""
    if num_experts < 1:
        raise ValueError(f"capacity: num_experts={num_experts}; it must be at least 1.")
    _check_factor("capacity_factor", capacity_factor)
    per_expert = torch.tensor(num_tokens / num_experts, dtype=torch.float32)
    factor = torch.tensor(capacity_factor * k, dtype=torch.float32)
    return max(int(torch.ceil(per_expert * factor)), int(min_capacity))


def _check_factor(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{name}={value}: it must be > 0 (1.0 gives each expert an equal "
                         "share of the tokens' slots).")


# -- noise --------------------------------------------------------------------------------------


def jitter(x: torch.Tensor, epsilon: float = 1e-2, *,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """`x` times uniform noise in [1 - epsilon, 1 + epsilon) (Switch's multiplicative jitter,
    which `Gate` applies to the router's *input* in training with noisy_gate_policy="Jitter").
    One `torch.rand(x.shape)` draw, Note [random numbers in gating]; epsilon=0 draws nothing."""
    if epsilon == 0:
        return x
    low = torch.tensor(1.0 - epsilon, device=x.device)
    high = torch.tensor(1.0 + epsilon, device=x.device)
    u = torch.rand(x.shape, generator=generator, device=x.device, dtype=torch.float32)
    return x * (low + u * (high - low))


def gumbel_noise(shape: torch.Size | tuple[int, ...], device: torch.device | str | None = None,
                 *, generator: torch.Generator | None = None) -> torch.Tensor:
    """Gumbel(0, 1) noise, -log(-log(u)), float32: argmax(logits + noise) samples an expert
    from softmax(logits) (the Gumbel-max trick). One `torch.rand(shape)` draw; u is kept in
    [tiny, 1 - eps] exactly as torch.distributions.Gumbel (which DeepSpeed uses) keeps it,
    so the same seed gives the same noise bit for bit."""
    finfo = torch.finfo(torch.float32)
    low = torch.tensor(finfo.tiny, device=device)
    high = torch.tensor(1.0 - finfo.eps, device=device)
    u = torch.rand(shape, generator=generator, device=device, dtype=torch.float32)
    return -torch.log(-torch.log(low + u * (high - low)))


# -- the routing --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)  # eq on tensors has no single truth value
class Routing:
    """Where each of S tokens goes, for E experts of `capacity` slots each.

    Row s, column j describes token s's j-th choice (k = 1 or 2 columns). A kept choice
    has a slot in [0, capacity), unique per expert; slots are filled from 0 without gaps.
    A dropped choice (its expert was full, or `used_token` excluded the token) has slot -1
    and weight 0, and contributes nothing to `dispatch` or `combine`. Raising `capacity`
    (dataclasses.replace, e.g. to pad to a multiple of the tensor-parallel degree) keeps
    the routing valid; lowering it does not.
    """

    expert_index: torch.Tensor  # [S, k] int64: the chosen expert (also for dropped choices)
    slot: torch.Tensor          # [S, k] int64: slot in that expert's buffer, -1 if dropped
    weight: torch.Tensor        # [S, k] float32: combine weight, 0 if dropped; carries grad
    exp_counts: torch.Tensor    # [E] int64: choices routed to each expert BEFORE capacity drops
    capacity: int               # C: slots per expert
    l_aux: torch.Tensor         # scalar: load-balancing loss, Note [load-balancing loss]
    z_loss: torch.Tensor        # scalar: router z-loss, mean_s logsumexp(logits_s)^2 (ST-MoE)

    @property
    def num_experts(self) -> int:
        return self.exp_counts.numel()

    @property
    def kept(self) -> torch.Tensor:
        """[S, k] bool: the choices that hold a slot."""
        return self.slot >= 0

    @property
    def flat_slot(self) -> torch.Tensor:
        """[S, k] int64: row in the flattened [E * C] buffer, -1 if dropped."""
        return torch.where(self.kept, self.expert_index * self.capacity + self.slot, -1)

    def dispatch(self, x: torch.Tensor) -> torch.Tensor:
        """x [S, M] -> [E, C, M]: buffer[e, c] is the token in slot c of expert e, zeros where
        no token is. Differentiable in x; index ops only (no S*E*C tensor)."""
        num_tokens, k = self.slot.shape
        if x.dim() != 2 or x.shape[0] != num_tokens:
            raise ValueError(f"Routing.dispatch: x has shape {tuple(x.shape)}; expected "
                             f"[{num_tokens}, model_dim], one row per routed token.")
        rows = self.num_experts * self.capacity
        # A gather, Note [dispatch and combine as gathers]: the token of each slot, then one
        # index_select. Dropped choices name one scratch slot past the end, which is cut
        # off: no data-dependent shape (no host sync).
        target = torch.where(self.kept, self.flat_slot, rows).reshape(-1)
        token = torch.arange(num_tokens, device=x.device)
        token = token if k == 1 else token.repeat_interleave(k)  # entry s*k + j: token s
        source = torch.full((rows + 1,), num_tokens, dtype=torch.long, device=x.device)
        source = source.scatter_(0, target, token)[:rows]  # empty slots: row num_tokens, zeros
        padded = torch.cat([x, x.new_zeros(1, x.shape[1])])
        return padded.index_select(0, source).view(self.num_experts, self.capacity, x.shape[1])

    def combine(self, expert_out: torch.Tensor) -> torch.Tensor:
        """expert_out [E, C, M] -> [S, M]: each token's sum over its kept choices of
        weight * expert_out[expert, slot]; zeros for a token with no kept choice. Summed in
        float32 (the weights' dtype), returned in expert_out's dtype. Differentiable in
        expert_out and in the weights (so in the router)."""
        num_tokens, k = self.slot.shape
        shape = (self.num_experts, self.capacity)
        if expert_out.dim() != 3 or tuple(expert_out.shape[:2]) != shape:
            raise ValueError(f"Routing.combine: expert_out has shape {tuple(expert_out.shape)}; "
                             f"expected [{shape[0]}, {shape[1]}, model_dim] ([experts, capacity, "
                             "model_dim], the shape dispatch returns).")
        model_dim = expert_out.shape[2]
        if self.capacity == 0:
            return expert_out.new_zeros(num_tokens, model_dim)
        rows = self.num_experts * self.capacity
        # Dropped choices read a zero row past the end, not slot 0 times weight 0: an inf
        # or nan in slot 0 must not leak into them (Note [dispatch and combine as gathers]).
        flat = torch.cat([expert_out.reshape(rows, model_dim), expert_out.new_zeros(1, model_dim)])
        routed = flat.index_select(0, torch.where(self.kept, self.flat_slot, rows).reshape(-1))
        out = (routed.view(num_tokens, k, model_dim) * self.weight.unsqueeze(-1)).sum(1)
        return out.to(expert_out.dtype)

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSpeed's einsum form: (combine_weights [S, E, C] float32, dispatch_mask [S, E, C]
        bool), with dispatch = einsum("sec,sm->ecm", mask, x) and combine =
        einsum("sec,ecm->sm", weights, out). O(S*E*C) memory: for comparison and
        compatibility. dispatch_mask marks kept choices (DeepSpeed's is weights != 0,
        which differs only where a kept gate weight underflows to exactly 0)."""
        num_tokens = self.slot.shape[0]
        cols = self.num_experts * self.capacity
        target = torch.where(self.kept, self.flat_slot, cols)  # scratch column, cut off
        weights = self.weight.new_zeros(num_tokens, cols + 1).scatter(1, target, self.weight)
        mask = torch.zeros(num_tokens, cols + 1, dtype=torch.bool, device=self.slot.device)
        mask = mask.scatter(1, target, True)
        shape = (num_tokens, self.num_experts, self.capacity)
        return weights[:, :cols].reshape(shape), mask[:, :cols].reshape(shape)


# Note [dispatch and combine as gathers]
# Both directions are one index_select over a copy of the source with a zero row appended:
# dispatch names the token of every slot (the zero row for empty slots), combine the slot
# of every choice (the zero row for dropped ones). A scatter into a zero-filled buffer
# (index_copy) costs a fill and a copy of the [E * C, M] buffer, plus a [S * k, M] copy of
# x for k = 2, and its backward as much again; masking the dropped choices with `where`
# costs a pass over [S * k, M] each way. The gather's backward is one index_add into zeros.
# The results are the same bit for bit: the same rows are copied, and a token's gradient
# sums its k <= 2 slots' gradients (a + b in either order).


# -- top-1 and top-2 ----------------------------------------------------------------------------

# Note [load-balancing loss]
# l_aux = E * sum_e mean_s(gates[s, e]) * mean_s(first_choice[s, e]) (Switch eq. 4; DeepSpeed's
# formula for top-1 and top-2 alike, where the fraction counts first choices only, before
# capacity drops, and the mean gate is over all S tokens, used or not). Only the mean
# gate carries gradient. A uniform router (all gates 1/E) gives exactly 1, whatever it picks.

# Note [which tokens an over-full expert keeps]
# top-1, use_rts=False: the first `capacity` tokens in token order (GShard). DeepSpeed
# selects them with topk over a 0/1 mask, whose choice among equal values is left to the
# kernel (CPU torch picks neither the first nor a fixed subset), so there it is unspecified.
# top-1, use_rts=True: the `capacity` tokens of highest uniform priority (random token
# selection, Kim et al. arXiv:2109.10465), ties (equal float32 draws) going to the earlier
# token. Either way the kept tokens then take slots 0, 1, ... in token order. top-2 has no
# RTS: each expert's first choices in token order, then its second choices in token order,
# counted before dropping, and a choice whose place is >= capacity is dropped.

# Note [dropless capacity]
# drop_tokens=False: capacity = the largest exp_counts entry, MAX-reduced over
# capacity_group when one is given so that all ranks of an all-to-all agree on the buffer
# shape; min_capacity does not apply (as in DeepSpeed). Two differences from DeepSpeed:
# DeepSpeed's top-1 then clamps to the local token count, which can only bite when ranks
# hold different token counts, and then makes their buffer shapes disagree, so we do not;
# DeepSpeed rounds up to a multiple of the tensor-parallel degree, which the layer (which
# knows that degree) does with dataclasses.replace(routing, capacity=...).


def top1_routing(logits: torch.Tensor, capacity_factor: float = 1.0, min_capacity: int = 4, *,
                 used_token: torch.Tensor | None = None, rsample: bool = False,
                 drop_tokens: bool = True, use_rts: bool = True, capacity_group: Any = None,
                 generator: torch.Generator | None = None) -> Routing:
    """Switch routing of logits [S, E]: each token to argmax softmax(logits), or to
    argmax(logits + Gumbel noise) with `rsample`, weighted by its softmax gate (not
    renormalised). Capacity: `capacity(S, E, capacity_factor, min_capacity)` with
    `drop_tokens`, else Note [dropless capacity]. Over-full experts: Note [which tokens an
    over-full expert keeps]. `used_token` [S] (nonzero = used) leaves the others unrouted.
    Random draws: Note [random numbers in gating]. Computed in float32."""
    logits = _check_logits(logits, k=1)
    num_tokens, num_experts = logits.shape
    gates = F.softmax(logits, dim=1)
    if rsample:
        noisy = logits + gumbel_noise(logits.shape, logits.device, generator=generator)
        expert = noisy.argmax(dim=1)
    else:
        expert = gates.argmax(dim=1)
    used = _used(used_token, num_tokens, logits.device)
    onehot = F.one_hot(expert, num_experts) * used.unsqueeze(1)
    exp_counts = onehot.sum(dim=0)
    priority = None
    if use_rts:  # drawn even when nothing can drop: DeepSpeed's random stream, Note [random...]
        priority = torch.rand(logits.shape, generator=generator, device=logits.device,
                              dtype=torch.float32)
    cap = _capacity_of(drop_tokens, num_tokens, num_experts, capacity_factor, min_capacity, 1,
                       exp_counts, capacity_group)

    keep = used
    if drop_tokens:
        if priority is None:
            rank = _place_in_expert(onehot, expert)
        else:  # rank by priority, highest first: place in the expert's queue in that order
            order = priority.gather(1, expert.unsqueeze(1)).squeeze(1).argsort(
                descending=True, stable=True)
            rank = torch.empty_like(expert).scatter_(
                0, order, _place_in_expert(onehot[order], expert[order]))
        keep = used & (rank < cap)
    slot = torch.where(keep, _place_in_expert(onehot * keep.unsqueeze(1), expert), -1)
    weight = gates.gather(1, expert.unsqueeze(1)).squeeze(1) * keep
    return Routing(expert_index=expert.unsqueeze(1), slot=slot.unsqueeze(1),
                   weight=weight.unsqueeze(1), exp_counts=exp_counts, capacity=cap,
                   l_aux=_balance_loss(gates, onehot), z_loss=_z_loss(logits))


def top2_routing(logits: torch.Tensor, capacity_factor: float = 1.0, min_capacity: int = 4, *,
                 used_token: torch.Tensor | None = None, drop_tokens: bool = True,
                 second_expert_sampling: bool = True, capacity_group: Any = None,
                 generator: torch.Generator | None = None) -> Routing:
    """GShard routing of logits [S, E], E >= 2: first expert argmax softmax(logits); second
    the argmax of the other experts' logits, plus Gumbel noise with `second_expert_sampling`
    (i.e. sampled from the softmax over the remaining experts). The two kept gates are
    renormalised to sum to 1 (denominator at least float32 eps, so a token with both
    choices dropped gets weights 0). Capacity: `capacity(S, E, capacity_factor,
    min_capacity, k=2)` with `drop_tokens`, else Note [dropless capacity]; slots: Note
    [which tokens an over-full expert keeps]. `used_token` [S] (nonzero = used) leaves the
    others unrouted (DeepSpeed's top-2 ignores it). Random draws: Note [random numbers in
    gating]. Computed in float32."""
    logits = _check_logits(logits, k=2)
    num_tokens, num_experts = logits.shape
    gates = F.softmax(logits, dim=1)
    first = gates.argmax(dim=1)
    first_hot = F.one_hot(first, num_experts)
    scores = logits
    if second_expert_sampling:
        scores = logits + gumbel_noise(logits.shape, logits.device, generator=generator)
    second = scores.masked_fill(first_hot.bool(), float("-inf")).argmax(dim=1)
    used = _used(used_token, num_tokens, logits.device).unsqueeze(1)
    first_hot, second_hot = first_hot * used, F.one_hot(second, num_experts) * used
    exp_counts = (first_hot + second_hot).sum(dim=0)
    cap = _capacity_of(drop_tokens, num_tokens, num_experts, capacity_factor, min_capacity, 2,
                       exp_counts, capacity_group)

    expert = torch.stack([first, second], dim=1)
    place = torch.stack([_place_in_expert(first_hot, first),
                         _place_in_expert(second_hot, second) + first_hot.sum(0)[second]], dim=1)
    keep = used & (place < cap) if drop_tokens else used.expand(-1, 2)
    gate = gates.gather(1, expert) * keep
    denom = gate.sum(dim=1, keepdim=True).clamp(min=torch.finfo(gate.dtype).eps)
    return Routing(expert_index=expert, slot=torch.where(keep, place, -1), weight=gate / denom,
                   exp_counts=exp_counts, capacity=cap, l_aux=_balance_loss(gates, first_hot),
                   z_loss=_z_loss(logits))


# Note [top-k routing]
# k >= 1 experts per token (DeepSpeed's `topkgating`, which its TopKGate uses for k > 2):
# the k largest softmax gates, columns in decreasing gate order (ties: the lower expert
# index, torch.topk's order). Unlike top-2, the k choices are alike: the balance loss
# counts all of them, l_aux = E / k * sum_e mean_s(gates[s, e]) * mean_s(chosen[s, e])
# (a uniform router gives 1), and an expert's slots go to its tokens in token order,
# whatever place the expert has among each token's choices. Over-full experts:
# drop_policy="probs" keeps the `capacity` tokens with the largest gate for that expert
# (ties: the earlier token; DeepSpeed's topk leaves ties unspecified), "position" the
# first `capacity` in token order. The kept gates of a token are renormalised to sum to 1.


def topk_routing(logits: torch.Tensor, k: int, capacity_factor: float = 1.0, min_capacity: int = 4,
                 *, used_token: torch.Tensor | None = None, drop_tokens: bool = True,
                 drop_policy: str = "probs", capacity_group: Any = None) -> Routing:
    """Top-k routing of logits [S, E], 1 <= k <= E, Note [top-k routing]. Capacity:
    `capacity(S, E, capacity_factor, min_capacity, k=k)` with `drop_tokens`, else Note
    [dropless capacity]. `used_token` [S] (nonzero = used) leaves the others unrouted
    (DeepSpeed's topkgating has no used_token). No random draws. Computed in float32."""
    if drop_policy not in DROP_POLICIES:
        raise ValueError(f"topk_routing: drop_policy={drop_policy!r} is not one of "
                         f"{', '.join(map(repr, DROP_POLICIES))} (which tokens an over-full expert "
                         "keeps: the largest gates, or the first in token order).")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"topk_routing: k={k!r}; it must be an int >= 1 (experts per token).")
    logits = _check_logits(logits, k=k, name="topk_routing")
    num_tokens, num_experts = logits.shape
    gates = F.softmax(logits, dim=1)
    expert = gates.topk(k, dim=1).indices  # [S, k]
    used = _used(used_token, num_tokens, logits.device)
    chosen = torch.zeros_like(gates, dtype=torch.bool).scatter_(1, expert, True) & used.unsqueeze(1)
    exp_counts = chosen.sum(dim=0)
    cap = _capacity_of(drop_tokens, num_tokens, num_experts, capacity_factor, min_capacity, k,
                       exp_counts, capacity_group)

    kept = chosen
    if drop_tokens and drop_policy == "position":
        kept = chosen & (chosen.cumsum(dim=0) <= cap)
    elif drop_tokens:  # each expert's tokens by decreasing gate, then token order
        order = torch.where(chosen, gates, -1.0).argsort(dim=0, descending=True, stable=True)
        rank = torch.empty_like(order).scatter_(
            0, order, torch.arange(num_tokens, device=logits.device).unsqueeze(1).expand_as(order))
        kept = chosen & (rank < cap)
    keep = kept.gather(1, expert)  # [S, k]
    place = (kept.cumsum(dim=0) - 1).gather(1, expert)
    gate = gates.gather(1, expert) * keep
    denom = gate.sum(dim=1, keepdim=True).clamp(min=torch.finfo(gate.dtype).eps)
    return Routing(expert_index=expert, slot=torch.where(keep, place, -1), weight=gate / denom,
                   exp_counts=exp_counts, capacity=cap, l_aux=_balance_loss(gates, chosen) / k,
                   z_loss=_z_loss(logits))


def _check_logits(logits: torch.Tensor, k: int, name: str | None = None) -> torch.Tensor:
    name = name or f"top{k}_routing"
    if logits.dim() != 2:
        raise ValueError(f"{name}: logits has shape {tuple(logits.shape)}; expected "
                         "[tokens, experts] (flatten batch and sequence into tokens first).")
    if logits.shape[1] < k:
        raise ValueError(f"{name}: {logits.shape[1]} expert(s) for k={k}; each token "
                         f"needs {k} distinct experts, so use at least {k} experts or a smaller k.")
    return logits.float()


def _used(used_token: torch.Tensor | None, num_tokens: int, device: torch.device) -> torch.Tensor:
    if used_token is None:
        return torch.ones(num_tokens, dtype=torch.bool, device=device)
    if used_token.shape != (num_tokens,):
        raise ValueError(f"used_token has shape {tuple(used_token.shape)}; expected "
                         f"[{num_tokens}], one entry per token (nonzero = route it).")
    return used_token.to(device) != 0


def _place_in_expert(onehot: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
    """[S]: how many tokens before s (in row order) have a 1 in token s's expert column,
    i.e. token s's place in its expert's queue (meaningful where onehot[s] is set)."""
    return (onehot.cumsum(dim=0) - 1).gather(1, expert.unsqueeze(1)).squeeze(1)


def _capacity_of(drop_tokens: bool, num_tokens: int, num_experts: int, capacity_factor: float,
                 min_capacity: int, k: int, exp_counts: torch.Tensor, group: Any) -> int:
    if drop_tokens:
        return capacity(num_tokens, num_experts, capacity_factor, min_capacity, k=k)
    largest = exp_counts.max().clone()  # Note [dropless capacity]
    if group is not None and comm.get_world_size(group) > 1:
        comm.all_reduce(largest, group=group, op="max")
    return int(largest)


def _balance_loss(gates: torch.Tensor, first_hot: torch.Tensor) -> torch.Tensor:
    """Note [load-balancing loss]. A rank with no tokens contributes 0 (not the NaN of a
    mean over nothing, which would reach the gate's gradient on every data-parallel rank)."""
    if gates.shape[0] == 0:
        return gates.sum() * 0.0
    fraction = first_hot.float().mean(dim=0)
    return (gates.mean(dim=0) * fraction).sum() * gates.shape[1]


def _z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE (arXiv:2202.08906) eq. 5: mean over tokens of logsumexp(logits)^2, on the
    logits before any routing noise; 0 for a rank with no tokens."""
    if logits.shape[0] == 0:
        return logits.sum() * 0.0
    return torch.logsumexp(logits, dim=1).square().mean()


# -- the module ---------------------------------------------------------------------------------


@functools.cache
def _warn_once_on_rank_zero(message: str) -> None:
    """Log `message` once per process, on rank 0 (before the process group exists, the
    launcher's RANK says which rank this is)."""
    rank = comm.get_rank() if comm.is_initialized() else int(os.environ.get("RANK", "0"))
    if rank == 0:
        logger.warning(message)


class Gate(nn.Module):
    """DeepSpeed's `TopKGate`: `wg` (bias-free Linear, DeepSpeed's name and layout, so
    checkpoints line up) applied in float32, then `top1_routing` (k=1), `top2_routing`
    (k=2) or `topk_routing` with drop_policy "probs" (k >= 3, as DeepSpeed's TopKGate).

    capacity_factor applies in training, eval_capacity_factor in eval. noisy_gate_policy,
    in training only: "Jitter" multiplies the router input by `jitter` noise (any k);
    "RSample" picks the top-1 expert from Gumbel-noised logits (with k >= 2 it has no
    effect, as in DeepSpeed, and rank 0 logs a warning once). use_rts (top-1)
    and top2_2nd_expert_sampling (top-2) apply in eval too, as in DeepSpeed. capacity_group:
    the expert-parallel group whose ranks must agree on the dropless capacity. Random draws:
    Note [random numbers in gating].
    """

    def __init__(self, model_dim: int, num_experts: int, k: int = 1, *,
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0,
                 min_capacity: int = 4, noisy_gate_policy: str | None = None,
                 drop_tokens: bool = True, use_rts: bool = True,
                 top2_2nd_expert_sampling: bool = True, capacity_group: Any = None) -> None:
        super().__init__()
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"Gate: k={k!r} is not supported; k=1 (Switch top-1), k=2 (GShard "
                             "top-2) or any larger int (top-k) is.")
        if num_experts < k:
            raise ValueError(f"Gate: k={k} is larger than num_experts={num_experts}; each "
                             f"token needs {k} distinct experts.")
        if noisy_gate_policy not in NOISY_GATE_POLICIES:
            raise ValueError(f"Gate: noisy_gate_policy={noisy_gate_policy!r} is not one of "
                             f"{', '.join(map(repr, NOISY_GATE_POLICIES))}.")
        noisy_gate_policy = None if noisy_gate_policy == "None" else noisy_gate_policy
        if noisy_gate_policy == "RSample" and k >= 2:  # DeepSpeed accepts it and ignores it
            _warn_once_on_rank_zero(
                f"MoE gate: noisy_gate_policy='RSample' has no effect with k={k} (it samples the "
                "top-1 expert only; top-2 samples its second expert with "
                "top2_2nd_expert_sampling=True); DeepSpeed ignores it there too. Drop the "
                "policy, or use 'Jitter' to add noise to a top-2 router.")
        _check_factor("capacity_factor", capacity_factor)
        _check_factor("eval_capacity_factor", eval_capacity_factor)
        if min_capacity < 0:
            raise ValueError(f"Gate: min_capacity={min_capacity}; it must be >= 0.")
        self.wg = nn.Linear(model_dim, num_experts, bias=False)
        self.model_dim, self.num_experts, self.k = model_dim, num_experts, k
        self.capacity_factor, self.eval_capacity_factor = capacity_factor, eval_capacity_factor
        self.min_capacity, self.noisy_gate_policy = min_capacity, noisy_gate_policy
        self.drop_tokens, self.use_rts = drop_tokens, use_rts
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling
        self.capacity_group = capacity_group

    def forward(self, x: torch.Tensor, used_token: torch.Tensor | None = None, *,
                generator: torch.Generator | None = None) -> Routing:
        """x [S, model_dim] (any float dtype) -> the Routing of its S tokens."""
        if x.dim() != 2 or x.shape[1] != self.model_dim:
            raise ValueError(f"Gate: x has shape {tuple(x.shape)}; expected [tokens, "
                             f"{self.model_dim}] (flatten batch and sequence into tokens first).")
        x = x.float()
        if self.training and self.noisy_gate_policy == "Jitter":
            x = jitter(x, generator=generator)
        logits = F.linear(x, self.wg.weight.float())
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        common = {"used_token": used_token, "drop_tokens": self.drop_tokens,
                  "capacity_group": self.capacity_group, "generator": generator}
        if self.k == 1:
            return top1_routing(logits, factor, self.min_capacity, use_rts=self.use_rts,
                                rsample=self.training and self.noisy_gate_policy == "RSample",
                                **common)
        if self.k == 2:
            return top2_routing(logits, factor, self.min_capacity,
                                second_expert_sampling=self.top2_2nd_expert_sampling, **common)
        del common["generator"]  # top-k draws nothing
        return topk_routing(logits, self.k, factor, self.min_capacity, **common)

    def extra_repr(self) -> str:
        return (f"model_dim={self.model_dim}, num_experts={self.num_experts}, k={self.k}, "
                f"capacity_factor={self.capacity_factor}, "
                f"eval_capacity_factor={self.eval_capacity_factor}, "
                f"min_capacity={self.min_capacity}, noisy_gate_policy={self.noisy_gate_policy!r}, "
                f"drop_tokens={self.drop_tokens}, use_rts={self.use_rts}, "
                f"top2_2nd_expert_sampling={self.top2_2nd_expert_sampling}")
