"""Typed config fields that meshspeed parses but that change nothing it does, and why.

DeepSpeed scripts set these; their values are checked (a wrong type is still an error)
but meshspeed's design makes the choice for them. Setting one to a value other than its
default is reported once, on rank 0, with the reason. A field whose non-default value
would ask for different numerics is a ConfigError instead: training on without it would
silently give other results than the user asked for.
"""

from __future__ import annotations

import logging

from pydantic import BaseModel

from meshspeed.config.errors import ConfigError

logger = logging.getLogger("meshspeed")

# dotted path -> why it has no effect
NO_EFFECT: dict[str, str] = {
    "zero_optimization.contiguous_gradients": "gradients are always collected in one flat "
    "buffer per unit (meshspeed/parallel/zero/flat.py)",
    "zero_optimization.reduce_scatter": "stages 1-3 always reduce-scatter gradients (an all-reduce "
    "would move twice the bytes for the same result)",
    "zero_optimization.allgather_partitions": "updated shards are always all-gathered, one "
    "collective per unit",
    "zero_optimization.allgather_bucket_size": "a unit is all-gathered whole; unit sizes follow "
    "reduce_bucket_size and the model's blocks",
    "zero_optimization.round_robin_gradients": "offloaded gradients are copied per unit as each "
    "reduction lands, on every rank",
    "zero_optimization.stage3_max_reuse_distance": "stage 3 releases a unit after each use and "
    "prefetches by the recorded order; max_live_parameters bounds what stays gathered",
    "checkpoint.parallel_write": "each rank writes its own shard file already",
    # Note [contiguous_memory_optimization and number_checkpoints] in parallel/activation_setup.py
    "activation_checkpointing.contiguous_memory_optimization": "kept inputs are not copied into one "
    "buffer: every slice of a block has the same size, so the caching allocator reuses the same "
    "blocks step after step (and host memory has nothing to defragment)",
    "activation_checkpointing.number_checkpoints": "it sizes the contiguous buffer, which meshspeed "
    "does not build (see contiguous_memory_optimization)",
    "pipeline.pipe_partitioned": "every tensor-parallel rank sends its whole activation to its "
    "peer on the next stage (the same numbers; docs/pipeline.md)",
    "pipeline.grad_partitioned": "every tensor-parallel rank sends its whole gradient to its peer "
    "on the previous stage (the same numbers; docs/pipeline.md)",
    "pipeline.partition": "PipelineModule(partition_method=...) decides the cut, as in DeepSpeed",
    "pipeline.seed_layers": "PipelineModule(seed_layers=...) decides, as in DeepSpeed",
    "dump_state": "the resolved config is available as engine.config",
    "compression_training.weight_quantization.shared_parameters.quantizer_kernel": "weights are "
    "quantized with torch ops in the forward; DeepSpeed's CUDA kernel was a speed choice",
}

# dotted path -> what to do instead; a non-default value is refused
REFUSED: dict[str, str] = {
    "prescale_gradients": "meshspeed sums gradients and divides once after the reduction "
    "(in fp32 unless communication_data_type says otherwise); remove the key",
    "gradient_predivide_factor": "meshspeed divides once after the reduction; remove the key",
    "gradient_allreduce_op": "meshspeed averages gradients over the data-parallel ranks; for DeepSpeed's "
    "sum, multiply the loss by the data-parallel size",
    "fp16.auto_cast": "the model is cast to fp16 whole; torch.autocast inside the model's forward "
    "gives mixed-dtype compute",
}


def _value(cfg: BaseModel, path: str):
    """(value, default, explicitly set) of the field at `path`, or None when absent."""
    *parents, leaf = path.split(".")
    node = cfg
    for name in parents:
        node = getattr(node, name, None)
        if node is None:
            return None
    if not isinstance(node, BaseModel) or leaf not in type(node).model_fields:
        return None
    field = type(node).model_fields[leaf]
    return getattr(node, leaf), field.get_default(call_default_factory=True), leaf in node.model_fields_set


def report_no_effect(cfg: BaseModel, rank: int = 0) -> list[str]:
    """Raise ConfigError for refused values; log (rank 0) and return the no-effect ones."""
    refused = []
    for path, instead in REFUSED.items():
        got = _value(cfg, path)
        if got and got[2] and got[0] != got[1]:
            refused.append(f"{path}: {got[0]!r} is not supported ({instead})")
    if refused:
        raise ConfigError(refused)
    notes = []
    for path, why in NO_EFFECT.items():
        got = _value(cfg, path)
        if got and got[2] and got[0] != got[1]:
            notes.append(f"{path}={got[0]!r} has no effect: {why}")
    if notes and rank == 0:
        logger.warning("config keys with no effect in meshspeed:\n  %s", "\n  ".join(notes))
    return notes
