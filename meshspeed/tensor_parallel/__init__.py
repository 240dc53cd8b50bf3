"""Tensor parallelism (Megatron-LM, arXiv:1909.08053) with sequence parallelism
(arXiv:2205.05198): layers that split their weights over a tensor-parallel process group."""

from meshspeed.tensor_parallel.apply import apply_tensor_parallel
from meshspeed.tensor_parallel.ds_config import plan_from_deepspeed
from meshspeed.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    SharedGather,
    VocabParallelCrossEntropy,
    VocabParallelEmbedding,
    mark_sequence_parallel,
    vocab_parallel_cross_entropy,
)
from meshspeed.tensor_parallel.plan import PlanError
from meshspeed.topology.shards import (
    TPShard,
    partial_grad_params,
    shards_by_name,
    shards_by_param,
)

__all__ = ["ColumnParallelLinear", "PlanError", "RowParallelLinear", "SharedGather", "TPShard",
           "VocabParallelCrossEntropy", "VocabParallelEmbedding", "apply_tensor_parallel",
           "mark_sequence_parallel", "partial_grad_params", "plan_from_deepspeed",
           "shards_by_name", "shards_by_param", "vocab_parallel_cross_entropy"]
