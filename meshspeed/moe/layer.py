"""`MoE`: DeepSpeed's Mixture-of-Experts layer (`deepspeed.moe.layer.MoE`), with expert
parallelism.

    moe = MoE(hidden_size=512, expert=mlp, num_experts=8, ep_size=2, k=2)
    moe.set_expert_group(ep_group)            # meshspeed.initialize does this for every MoE layer
    out, l_aux, exp_counts = moe(hidden_states)   # out: hidden_states' shape
    loss = task_loss + aux_coef * l_aux

Same signature, module tree and parameter marks as DeepSpeed 0.19, so that scripts,
checkpoints and optimizer-group code line up:

    moe.deepspeed_moe                              MOELayer
    moe.deepspeed_moe.gate.wg                      router, Linear(hidden, num_experts), no bias
    moe.deepspeed_moe.experts.deepspeed_experts[i] local expert i (a deep copy of `expert`),
                                                   global expert ep_rank * num_local_experts + i
    moe.mlp, moe.coefficient                       with use_residual=True only

Expert parameters carry `allreduce=False` and `group_name="ep_size_<ep_size>"` (see
experts.py); the gate, `mlp` and `coefficient` are ordinary data-parallel parameters.
Routing is per rank, as in DeepSpeed: each rank's gate routes its own tokens with its own
capacity. The gate is `gating.Gate`, the token exchange `dispatch`.

Note [gradients of expert parameters]
The backward of the all-to-alls brings every rank's gradient for local expert e home, so
after backward an expert parameter holds the gradient of the SUM over the ep group of the
ranks' losses, while a dense parameter holds this rank's alone. The data-parallel mean
over all dp ranks is therefore: dense gradients all-reduced over dp and divided by dp;
expert gradients all-reduced over edp (the ranks holding the same experts) and divided
by dp, not edp (DeepSpeed's engine does the same: `_reduce_expert_gradients`).

Note [one capacity over the ep group]
In capacity mode each rank routes its own S tokens with its own capacity C, as in DeepSpeed,
so the same tokens drop. But the all-to-all of the [E, C, M] buffers needs one C on every
rank of the ep group, and ranks holding different S (a short last batch, a data pipeline
that does not split evenly) compute different C: their buffers differ in size, which gloo
aborts on (SIGABRT) and NCCL may hang on or misread; DeepSpeed 0.19.8 does the same. So
the layer MAX-reduces C over the ep group and pads each rank's routing to it (a routing
stays valid with a larger capacity; the extra slots are zero rows, which no token reads).
Cost: one int64 all-reduce and one host sync per layer and forward; with the same S on
every rank (DeepSpeed's requirement) nothing else changes. Dropless mode needs none of
this: its exchange sends exact counts (dispatch.py, Note [dropless exchange]).

Differences from DeepSpeed (the first three in what was left to globals there):
  * process groups are handed in (`set_expert_group`), never created by the layer;
  * `use_tutel` is accepted and changes nothing: the dispatch is in index form already;
  * `enable_expert_tensor_parallelism` is recorded and has no effect: under tensor
    parallelism each tp rank holds whole experts and routes the same replicated tokens
    (Note [MoE layers on tensor-parallel ranks] in meshspeed/moe/axis.py), so there
    are no duplicate tokens to drop;
  * capacity mode with different token counts per rank works (Note [one capacity over
    the ep group]) instead of failing in the all-to-all;
  * noisy_gate_policy='RSample' with k=2 has no effect there and here, but here rank 0
    says so (gating.Gate);
  * `z_loss_coef` (keyword-only, default 0): the router z-loss of ST-MoE is kept as
    `moe.z_loss` after each forward, and `z_loss_coef * z_loss` is added to the returned
    l_aux when the coefficient is nonzero (a script's `aux_coef * l_aux` then weighs it by
    aux_coef * z_loss_coef).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from meshspeed import comm
from meshspeed.moe.dispatch import exchange_capacity, exchange_dropless
from meshspeed.moe.experts import Experts, expert_group_name
from meshspeed.moe.gating import NOISY_GATE_POLICIES, Gate, Routing

__all__ = ["MOELayer", "MoE"]


class MOELayer(nn.Module):
    """DeepSpeed's `MOELayer`: route this rank's tokens (`gate`), exchange them over the
    expert-parallel group, run the local `experts`, mix the results back. After forward
    `l_aux`, `exp_counts` and `z_loss` hold the last call's values, as DeepSpeed's do."""

    def __init__(self, gate: Gate, experts: Experts, ep_group_name: str, ep_size: int,
                 num_local_experts: int, use_tutel: bool = False) -> None:
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.ep_group: Any = None
        self.ep_size, self.ep_group_name = ep_size, ep_group_name
        self.num_local_experts = num_local_experts
        self.use_tutel = use_tutel
        self.l_aux: torch.Tensor | None = None
        self.exp_counts: torch.Tensor | None = None
        self.z_loss: torch.Tensor | None = None

    def set_expert_group(self, group: Any) -> None:
        """The expert-parallel group: ep_size ranks, rank r (within the group) holding
        experts [r * num_local_experts, (r + 1) * num_local_experts)."""
        if group is None:
            if self.ep_size > 1:
                raise ValueError(f"MoE: ep_size={self.ep_size} needs an expert-parallel group of "
                                 f"{self.ep_size} ranks; got None.")
        elif (size := comm.get_world_size(group)) != self.ep_size:
            raise ValueError(f"MoE: the expert-parallel group has {size} ranks but the layer was "
                             f"built with ep_size={self.ep_size}; hand it a group of {self.ep_size} "
                             "ranks (the mesh's ep axis) or build the layer with that ep_size.")
        self.ep_group = group

    _set_ep_group = set_expert_group  # DeepSpeed's name

    def forward(self, hidden_states: torch.Tensor,
                used_token: torch.Tensor | None = None) -> torch.Tensor:
        """hidden_states [..., M] -> [..., M]; used_token (same leading shape, or [S]):
        nonzero marks the tokens to route (top-1 only, as in DeepSpeed)."""
        if self.ep_size > 1 and self.ep_group is None:
            raise RuntimeError(f"MoE: ep_size={self.ep_size} but no expert-parallel group is set; "
                               "call meshspeed.initialize first (it hands every MoE layer its "
                               "group), or moe.set_expert_group(group).")
        model_dim = hidden_states.shape[-1]
        tokens = hidden_states.reshape(-1, model_dim)
        if used_token is not None and used_token.numel() == tokens.shape[0]:
            used_token = used_token.reshape(-1)
        routing = self.gate(tokens, used_token)
        if not isinstance(routing, Routing):
            raise TypeError(f"MOELayer: the gate ({type(self.gate).__name__}) returned a "
                            f"{type(routing).__name__}, not a Routing; build the layer with "
                            "meshspeed.moe.gating.Gate (DeepSpeed's TopKGate returns DeepSpeed's "
                            "tuples, for scripts that call it directly).")
        self.l_aux, self.exp_counts, self.z_loss = routing.l_aux, routing.exp_counts, routing.z_loss
        group = self.ep_group if self.ep_size > 1 else None
        if not self.gate.drop_tokens:
            return exchange_dropless(routing, tokens, self.experts, group).reshape(hidden_states.shape)
        if group is not None:
            routing = _capacity_over_group(routing, group)
        return exchange_capacity(routing, tokens, self.experts, group).reshape(hidden_states.shape)


def _capacity_over_group(routing: Routing, group: Any) -> Routing:
    """`routing` padded to the largest capacity of the group, Note [one capacity over the ep
    group]."""
    largest = torch.tensor(routing.capacity, dtype=torch.int64, device=routing.slot.device)
    comm.all_reduce(largest, group=group, op="max")
    cap = int(largest)
    return routing if cap == routing.capacity else dataclasses.replace(routing, capacity=cap)


class MoE(nn.Module):
    """DeepSpeed's MoE layer: `num_experts` copies of `expert` split over `ep_size` ranks,
    top-`k` gating (k = 1 or 2). forward(hidden_states [..., hidden_size], used_token=None)
    returns (output [..., hidden_size], l_aux, exp_counts [num_experts]). The arguments mean
    what DeepSpeed's do; drop_tokens=False is dropless (every token reaches its experts)."""

    def __init__(self, hidden_size: int, expert: nn.Module, num_experts: int = 1,
                 ep_size: int = 1, k: int = 1, capacity_factor: float = 1.0,
                 eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 use_residual: bool = False, noisy_gate_policy: str | None = None,
                 drop_tokens: bool = True, use_rts: bool = True, use_tutel: bool = False,
                 enable_expert_tensor_parallelism: bool = False,
                 top2_2nd_expert_sampling: bool = True, *, z_loss_coef: float = 0.0) -> None:
        super().__init__()
        if num_experts < 1 or ep_size < 1:
            raise ValueError(f"MoE: num_experts={num_experts}, ep_size={ep_size}; both must be >= 1.")
        if num_experts % ep_size:
            raise ValueError(f"MoE: num_experts={num_experts} is not divisible by ep_size={ep_size}; "
                             "every rank of the expert-parallel group holds the same number of "
                             "experts, so pick an ep_size that divides num_experts.")
        if k not in (1, 2):
            raise ValueError(f"MoE: k={k} is not supported; use k=1 (top-1) or k=2 (top-2).")
        if k > num_experts:
            raise ValueError(f"MoE: k={k} is larger than num_experts={num_experts}; each token "
                             f"goes to {k} distinct experts, so use at least {k} experts.")
        if noisy_gate_policy not in NOISY_GATE_POLICIES:
            raise ValueError(f"MoE: noisy_gate_policy={noisy_gate_policy!r} is not one of "
                             f"{', '.join(map(repr, NOISY_GATE_POLICIES))}.")
        if not isinstance(expert, nn.Module):
            raise TypeError(f"MoE: expert is a {type(expert).__name__}; pass the nn.Module each "
                            "expert is a copy of (e.g. a two-layer MLP).")
        self.use_residual = use_residual
        self.enable_expert_tensor_parallelism = enable_expert_tensor_parallelism
        self.ep_size = ep_size
        self.expert_group_name = expert_group_name(ep_size)
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        self.z_loss_coef = z_loss_coef
        # DeepSpeed's order: the copies (no random draws), then the gate's and the
        # coefficient's initialisation, so one seed gives the same weights as there.
        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        gate = Gate(hidden_size, num_experts, k, capacity_factor=capacity_factor,
                    eval_capacity_factor=eval_capacity_factor, min_capacity=min_capacity,
                    noisy_gate_policy=noisy_gate_policy, drop_tokens=drop_tokens,
                    use_rts=use_rts, top2_2nd_expert_sampling=top2_2nd_expert_sampling)
        self.deepspeed_moe = MOELayer(gate, experts, self.expert_group_name, ep_size,
                                      self.num_local_experts, use_tutel=use_tutel)
        if use_residual:
            self.mlp = expert  # the module given, as in DeepSpeed: a dense, unmarked expert
            self.coefficient = nn.Linear(hidden_size, 2)

    def set_expert_group(self, group: Any) -> None:
        """Hand the layer its expert-parallel group (ep_size ranks; None when ep_size is 1)."""
        self.deepspeed_moe.set_expert_group(group)

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False, *,
                                  ep_group: Any = None) -> None:
        """DeepSpeed's engine hook. meshspeed layers create no process groups: with
        `ep_group` this is `set_expert_group(ep_group)`; without one it only serves
        ep_size=1 layers."""
        if ep_group is not None or self.ep_size == 1:
            self.set_expert_group(ep_group)
            return
        raise RuntimeError(f"MoE.set_deepspeed_parallelism: meshspeed layers do not create process "
                           f"groups; meshspeed.initialize hands each MoE layer its ep group, or "
                           f"call set_expert_group(group) with a group of {self.ep_size} ranks.")

    @property
    def z_loss(self) -> torch.Tensor | None:
        """The router z-loss of the last forward (ST-MoE, arXiv:2202.08906), with gradient."""
        return self.deepspeed_moe.z_loss

    def forward(self, hidden_states: torch.Tensor, used_token: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:  # Residual MoE (DeepSpeed-MoE, arXiv:2201.05596, section 4.1)
            dense = self.mlp(hidden_states)
            if isinstance(dense, tuple):
                dense = dense[0]
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + dense * coef[..., 1:]
        l_aux = self.deepspeed_moe.l_aux
        if self.z_loss_coef:
            l_aux = l_aux + self.z_loss_coef * self.deepspeed_moe.z_loss
        return output, l_aux, self.deepspeed_moe.exp_counts
