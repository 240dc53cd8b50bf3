"""The experts one rank holds: copies of one module, marked as expert parameters.

DeepSpeed's `Experts` (`deepspeed/moe/experts.py`), with its module tree and marks, so that
checkpoints and optimizer-group code line up: `deepspeed_experts[i]` is local expert i, a
deep copy of the `expert` module given (so every copy starts from the same weights, the
given module's), and every parameter of every copy carries

    param.allreduce = False           # not averaged over all data-parallel ranks
    param.group_name = "ep_size_<ep>" # the expert-parallel group it belongs to

which is what `meshspeed.moe.utils.is_moe_param` and
`split_params_into_different_moe_groups_for_optimizer` read. These are plain attributes
on the parameters, the marks DeepSpeed scripts and checkpoints expect; nothing else is
attached to them.

What differs from DeepSpeed: `forward` takes one [tokens, model_dim] tensor per local
expert (DeepSpeed passes a [ep, local_experts, capacity, model_dim] block and chunks it),
because in dropless mode every expert receives a different number of tokens. An expert
is any module mapping [T, M] to [T, M] row by row (T may be 0); a tuple result is cut to
its first element (DeepSpeed's "ignore the bias term").
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["Experts", "expert_group_name"]


def expert_group_name(ep_size: int) -> str:
    """The `group_name` DeepSpeed gives expert parameters of layers with `ep_size`."""
    return f"ep_size_{ep_size}"


class Experts(nn.Module):
    """`num_local_experts` deep copies of `expert` in `deepspeed_experts`, parameters marked."""

    def __init__(self, expert: nn.Module, num_local_experts: int = 1,
                 expert_group_name: str | None = None) -> None:
        super().__init__()
        if not isinstance(expert, nn.Module):
            raise TypeError(f"Experts: expert is a {type(expert).__name__}; pass the nn.Module "
                            "each expert is a copy of (e.g. a two-layer MLP).")
        self.deepspeed_experts = nn.ModuleList(copy.deepcopy(expert) for _ in range(num_local_experts))
        self.num_local_experts = num_local_experts
        for module in self.deepspeed_experts:
            for param in module.parameters():
                param.allreduce = False
                param.group_name = expert_group_name

    def forward(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """inputs[i] [T_i, M] -> [local expert i applied to inputs[i]] ([T_i, M] each)."""
        if len(inputs) != self.num_local_experts:
            raise ValueError(f"Experts: got {len(inputs)} inputs for {self.num_local_experts} "
                             "local experts; pass one [tokens, model_dim] tensor per expert.")
        outputs = []
        for i, (x, module) in enumerate(zip(inputs, self.deepspeed_experts)):
            out = module(x)
            if isinstance(out, tuple):
                out = out[0]
            if out.shape != x.shape:
                raise ValueError(f"Experts: local expert {i} mapped {tuple(x.shape)} to "
                                 f"{tuple(out.shape)}; an expert must keep the shape "
                                 "[tokens, model_dim] (its output is mixed back into the tokens).")
            outputs.append(out)
        return outputs
