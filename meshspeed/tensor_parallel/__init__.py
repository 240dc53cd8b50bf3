"""Tensor parallelism (Megatron-LM, arXiv:1909.08053) with sequence parallelism
(arXiv:2205.05198): layers that split their weights over a tensor-parallel process group."""

from meshspeed.tensor_parallel.apply import apply_tensor_parallel
from meshspeed.tensor_parallel.ds_config import plan_from_deepspeed
from meshspeed.tensor_parallel.plan import PlanError
from meshspeed.tensor_parallel.spec import TPShard, shards_by_name, shards_by_param

__all__ = ["PlanError", "TPShard", "apply_tensor_parallel", "plan_from_deepspeed",
           "shards_by_name", "shards_by_param"]
