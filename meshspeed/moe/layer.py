"""`deepspeed.moe.layer.MoE`: named here so that scripts import; constructing it fails.

Expert parallelism (gating, token dispatch with all-to-all, expert-data-parallel groups)
is a later piece of work; an MoE layer that quietly ran as a dense layer would train a
different model than the script asks for.
"""

from __future__ import annotations

from torch import nn

__all__ = ["MoE"]


class MoE(nn.Module):
    def __init__(self, hidden_size: int, expert: nn.Module, num_experts: int = 1, ep_size: int = 1,
                 k: int = 1, *args, **kwargs):
        raise NotImplementedError(
            f"deepspeed.moe.layer.MoE(num_experts={num_experts}, ep_size={ep_size}, k={k}): "
            "Mixture-of-Experts layers are not available in meshspeed yet. Build the model "
            "without MoE layers (e.g. the script's dense option), or keep DeepSpeed for MoE training.")
