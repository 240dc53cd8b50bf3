"""`deepspeed.moe.sharded_moe`: DeepSpeed's gating functions and modules, over meshspeed.moe.

    l_aux, combine_weights, dispatch_mask, exp_counts = top1gating(logits, 1.0, 4)
    l_aux, capacity, num_experts, indices, locations, gates, exp_counts = top2gating(
        logits, 1.0, 4, sparse_routes=True)
    out = _sparse_decode(expert_out.view(E * C, M), _route_slots(indices, locations, E, C),
                         gates, S)

`top1gating`, `top2gating` and `topkgating` are meshspeed's routings (meshspeed.moe.gating:
top1_routing, top2_routing, topk_routing) returned in DeepSpeed's forms (Note [DeepSpeed's
gate outputs]); `TopKGate` is meshspeed's `Gate` returning those forms; `MOELayer` is
meshspeed's layer; `_AllToAll` is the capacity exchange's all-to-all, by attribute (Note
[the buffer all-to-all, by attribute] in meshspeed/moe/dispatch.py); `_route_slots`,
`_sparse_encode` and `_sparse_decode` are DeepSpeed's sparse dispatch helpers over
`Routing.dispatch` and `Routing.combine`.

Note [DeepSpeed's gate outputs]
Dense (the default): (l_aux, combine_weights [S, E, C] float32, dispatch_mask [S, E, C]
bool, exp_counts [E]) -- `Routing.dense()`. With sparse_routes=True: (l_aux, capacity (a
0-d int64 tensor), num_experts (int), indices [k, S] int32, locations [k, S] int32,
gates [k, S] float32, exp_counts), row j holding each token's j-th choice; a dropped
choice has index -1, location 0 and gate 0.

Note [the dropless capacity over ep_group]
drop_tokens=False: meshspeed's routing gives this rank's capacity (its largest
exp_counts entry); with an ep_group of more than one rank it is MAX-reduced through this
module's `dist` (deepspeed.comm), looked up at each call as DeepSpeed does, so a script or
test that replaces `deepspeed.comm.all_reduce` sees the reduction. ep_group=None makes no
collective call at all.

Departures from DeepSpeed 0.19.8, each for a reason given in meshspeed/moe/gating.py:
  * top1gating, drop_tokens=False: the capacity is not clamped to the local token count
    (Note [dropless capacity]): ranks of one all-to-all keep one buffer shape;
  * drop_tokens=False: the capacity is not rounded up to the tensor-parallel degree
    (`groups.mpu`): meshspeed's layer does not drop duplicate tp tokens;
  * top1gating with fewer tokens than min_capacity routes them (DeepSpeed asserts);
  * top1gating, use_rts=False: an over-full expert keeps its first tokens in token order
    (DeepSpeed's choice is left to torch.topk); topkgating "probs": equal gates go to the
    earlier token (Note [which tokens an over-full expert keeps], Note [top-k routing]);
  * dispatch_mask marks kept choices (DeepSpeed's is combine_weights != 0, which differs
    only where a kept gate underflows to 0);
  * top2gating does not add its Gumbel noise into the caller's logits tensor in place;
  * use_tutel is accepted and changes nothing (the routing is in index form already).
"""

from __future__ import annotations

from typing import Any

import torch

from meshspeed.compat.deepspeed import comm as dist
from meshspeed.moe.dispatch import BufferAllToAll
from meshspeed.moe.gating import (
    NOISY_GATE_POLICIES,
    Gate,
    Routing,
    capacity,
    gumbel_noise,
    jitter,
    top1_routing,
    top2_routing,
    topk_routing,
)
from meshspeed.moe.layer import MOELayer

__all__ = ["MOELayer", "TopKGate", "gumbel_rsample", "multiplicative_jitter", "top1gating",
           "top2gating", "topkgating"]

_AllToAll = BufferAllToAll  # DeepSpeed's name; replacing its `apply` reaches meshspeed's layers

GateOutput = tuple  # Note [DeepSpeed's gate outputs]


# -- DeepSpeed's forms of a routing -------------------------------------------------------------


def _outputs(routing: Routing, sparse_routes: bool) -> GateOutput:
    """Note [DeepSpeed's gate outputs]."""
    if not sparse_routes:
        combine_weights, dispatch_mask = routing.dense()
        return routing.l_aux, combine_weights, dispatch_mask, routing.exp_counts
    kept = routing.kept
    indices = torch.where(kept, routing.expert_index, -1).t().to(torch.int32).contiguous()
    locations = torch.where(kept, routing.slot, 0).t().to(torch.int32).contiguous()
    cap = torch.tensor(routing.capacity, dtype=torch.int64, device=routing.slot.device)
    return (routing.l_aux, cap, routing.num_experts, indices, locations,
            routing.weight.t().contiguous(), routing.exp_counts)


def _over_ep_group(routing: Routing, drop_tokens: bool, ep_group: Any) -> Routing:
    """Note [the dropless capacity over ep_group]: a routing stays valid with a larger
    capacity, so the group's largest replaces the local one."""
    if drop_tokens or ep_group is None or dist.get_world_size(ep_group) == 1:
        return routing
    largest = torch.tensor(routing.capacity, dtype=torch.int64, device=routing.slot.device)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=ep_group)
    return Routing(routing.expert_index, routing.slot, routing.weight, routing.exp_counts,
                   int(largest), routing.l_aux, routing.z_loss)


# -- the gating functions -----------------------------------------------------------------------


def top1gating(logits: torch.Tensor, capacity_factor: float, min_capacity: int,
               used_token: torch.Tensor | None = None, noisy_gate_policy: str | None = None,
               drop_tokens: bool = True, use_rts: bool = True, ep_group: Any = None,
               sparse_routes: bool = False, use_tutel: bool = False) -> GateOutput:
    """Switch top-1 routing of logits [S, E] (`top1_routing`); noisy_gate_policy="RSample"
    picks the expert from Gumbel-noised logits (the function applies it whenever given;
    TopKGate gives it in training only). Returns Note [DeepSpeed's gate outputs]."""
    if noisy_gate_policy not in NOISY_GATE_POLICIES:
        raise ValueError(f"top1gating: noisy_gate_policy={noisy_gate_policy!r} is not one of "
                         f"{', '.join(map(repr, NOISY_GATE_POLICIES))}.")
    routing = top1_routing(logits, float(capacity_factor), int(min_capacity), used_token=used_token,
                           rsample=noisy_gate_policy == "RSample", drop_tokens=drop_tokens,
                           use_rts=use_rts)
    return _outputs(_over_ep_group(routing, drop_tokens, ep_group), sparse_routes)


def top2gating(logits: torch.Tensor, capacity_factor: float, min_capacity: int,
               drop_tokens: bool = True, ep_group: Any = None, top2_2nd_expert_sampling: bool = True,
               sparse_routes: bool = False) -> GateOutput:
    """GShard top-2 routing of logits [S, E] (`top2_routing`), the second expert sampled
    with top2_2nd_expert_sampling. Returns Note [DeepSpeed's gate outputs]."""
    routing = top2_routing(logits, float(capacity_factor), int(min_capacity), drop_tokens=drop_tokens,
                           second_expert_sampling=top2_2nd_expert_sampling)
    return _outputs(_over_ep_group(routing, drop_tokens, ep_group), sparse_routes)


def topkgating(logits: torch.Tensor, k: int, capacity_factor: float, min_capacity: int,
               drop_tokens: bool = True, ep_group: Any = None, drop_policy: str = "probs",
               sparse_routes: bool = False) -> GateOutput:
    """Top-k routing of logits [S, E] (`topk_routing`, Note [top-k routing]); drop_policy
    "probs" or "position". Returns Note [DeepSpeed's gate outputs]."""
    routing = topk_routing(logits, k, float(capacity_factor), int(min_capacity),
                           drop_tokens=drop_tokens, drop_policy=drop_policy)
    return _outputs(_over_ep_group(routing, drop_tokens, ep_group), sparse_routes)


# -- the gate module ----------------------------------------------------------------------------


class EpGroupAlreadySet(AssertionError):
    """TopKGate._set_ep_group on a gate that has one (DeepSpeed asserts there)."""


class TopKGate(Gate):
    """DeepSpeed's TopKGate: meshspeed's `Gate` with DeepSpeed's positional signature
    (min_capacity defaults to 8, as there), whose forward returns Note [DeepSpeed's gate
    outputs]. meshspeed's MOELayer needs a `Gate` returning a Routing, so give it
    `meshspeed.moe.gating.Gate` (what `deepspeed.moe.layer.MoE` builds)."""

    def __init__(self, model_dim: int, num_experts: int, k: int = 1, capacity_factor: float = 1.0,
                 eval_capacity_factor: float = 1.0, min_capacity: int = 8,
                 noisy_gate_policy: str | None = None, drop_tokens: bool = True, use_rts: bool = True,
                 ep_group: Any = None, top2_2nd_expert_sampling: bool = True) -> None:
        super().__init__(model_dim, num_experts, k, capacity_factor=capacity_factor,
                         eval_capacity_factor=eval_capacity_factor, min_capacity=min_capacity,
                         noisy_gate_policy=noisy_gate_policy, drop_tokens=drop_tokens,
                         use_rts=use_rts, top2_2nd_expert_sampling=top2_2nd_expert_sampling,
                         capacity_group=ep_group)

    @property
    def ep_group(self) -> Any:
        return self.capacity_group

    def _set_ep_group(self, ep_group: Any) -> None:
        if self.capacity_group is not None:
            raise EpGroupAlreadySet("TopKGate._set_ep_group: this gate already has an "
                                    "expert-parallel group; set it once, on a gate built "
                                    "without ep_group.")
        self.capacity_group = ep_group

    def forward(self, input: torch.Tensor, used_token: torch.Tensor | None = None,
                sparse_routes: bool = False, use_tutel: bool = False) -> GateOutput:
        return _outputs(super().forward(input, used_token), sparse_routes)


# -- DeepSpeed's helpers ------------------------------------------------------------------------


def multiplicative_jitter(x: torch.Tensor, device: Any = None, epsilon: float = 1e-2) -> torch.Tensor:
    """`x` times uniform noise in [1 - epsilon, 1 + epsilon) (`gating.jitter`)."""
    return jitter(x, epsilon)


def gumbel_rsample(shape: tuple[int, ...], device: Any = None) -> torch.Tensor:
    """Gumbel(0, 1) noise of `shape` (`gating.gumbel_noise`)."""
    return gumbel_noise(shape, device)


def _capacity(gates: torch.Tensor, capacity_factor: Any, min_capacity: Any) -> torch.Tensor:
    """Slots per expert for gates [S, E] (`gating.capacity`), as a 0-d int64 tensor."""
    num_tokens, num_experts = gates.shape
    cap = capacity(num_tokens, num_experts, float(capacity_factor), int(min_capacity))
    return torch.tensor(cap, dtype=torch.int64, device=gates.device)


def _route_slots(indices: torch.Tensor, locations: torch.Tensor, num_experts: int,
                 capacity: int) -> torch.Tensor:
    """[k, S] int64: each choice's row in the flattened [E * C] buffer; a dropped choice
    (index < 0) names row E * C, one past the end."""
    rows = num_experts * capacity
    return torch.where(indices >= 0, indices.long() * capacity + locations.long(), rows)


def _flat_routing(slots: torch.Tensor, rows: int, gates: torch.Tensor | None = None) -> Routing:
    """The routing `slots` [k, S] describes, over one expert of `rows` slots: the [E * C]
    buffer flattened, which is all dispatch and combine need."""
    kept = (slots < rows).t()
    weight = torch.ones(kept.shape, device=slots.device) if gates is None else gates.t().float()
    zero = torch.zeros((), device=slots.device)
    return Routing(expert_index=torch.zeros_like(kept, dtype=torch.long),
                   slot=torch.where(kept, slots.t(), -1), weight=weight * kept,
                   exp_counts=kept.sum().reshape(1), capacity=rows, l_aux=zero, z_loss=zero)


def _sparse_encode(reshaped_input: torch.Tensor, slots: torch.Tensor, num_experts: int,
                   capacity: int) -> torch.Tensor:
    """x [S, M] -> [E, C, M], each routed token in its slot, zeros elsewhere
    (`Routing.dispatch`)."""
    rows = num_experts * capacity
    buffer = _flat_routing(slots, rows).dispatch(reshaped_input)
    return buffer.view(num_experts, capacity, reshaped_input.shape[1])


def _sparse_decode(expert_output: torch.Tensor, slots: torch.Tensor, gates: torch.Tensor,
                   num_tokens: int) -> torch.Tensor:
    """expert_output [E * C, M] -> [S, M]: each token's gate-weighted sum of its slots
    (`Routing.combine`, summed in float32)."""
    rows, model_dim = expert_output.shape
    if slots.shape[1] != num_tokens:
        raise ValueError(f"_sparse_decode: slots has shape {tuple(slots.shape)}; expected "
                         f"[k, {num_tokens}], one column per token.")
    return _flat_routing(slots, rows, gates).combine(expert_output.view(1, rows, model_dim))
