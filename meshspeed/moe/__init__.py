"""`meshspeed.moe`: Mixture of Experts with expert parallelism, at DeepSpeed's import paths.

gating.py    the router: which expert and slot each token takes (`Gate`, `Routing`)
experts.py   the local experts: deep copies of one module, parameters marked as experts'
dispatch.py  tokens to their experts and back over the expert-parallel group (all-to-all)
layer.py     `MoE` (DeepSpeed's `deepspeed.moe.layer.MoE`) and its `MOELayer`
utils.py     is_moe_param, split_params_into_different_moe_groups_for_optimizer

An MoE layer with ep_size > 1 needs its expert-parallel group (`MoE.set_expert_group`)
before its first forward; an ep_size=1 layer runs on one process as it is. Expert
parameters carry `allreduce=False`, so the split into optimizer groups moves them out.
"""

from meshspeed.moe import layer, utils

__all__ = ["layer", "utils"]
