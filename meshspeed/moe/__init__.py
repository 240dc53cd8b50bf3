"""`meshspeed.moe`: DeepSpeed's Mixture-of-Experts import paths.

`utils` (is_moe_param, split_params_into_different_moe_groups_for_optimizer) works today:
a model without MoE layers has no expert parameters, so the split leaves its parameter
groups as they are. The `layer.MoE` module itself is not implemented yet and says so
when constructed.
"""

from meshspeed.moe import layer, utils

__all__ = ["layer", "utils"]
