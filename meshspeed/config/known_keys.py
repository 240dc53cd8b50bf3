"""DeepSpeed config keys that meshspeed accepts but does not act on yet.

This is the one list to edit when a feature lands: delete the key here and add a typed
field to the owning model. A key in this set is accepted together with everything inside
it (so whole blocks such as `elasticity` take any content) and is named in a single
log line at load time. Keys that neither DeepSpeed nor meshspeed knows stay errors.

Paths are dotted from the top of the config: "zero_optimization.elastic_checkpoint".
"""

from __future__ import annotations

ACCEPTED_UNUSED: frozenset[str] = frozenset(
    {
        # --- top level: features and monitors meshspeed has no implementation of yet
        "amp",
        "comet",
        "compile",
        "curriculum_learning",
        "data_efficiency",
        "data_types",
        "dataloader_drop_last",
        "disable_allgather",
        "disable_python_gc",
        "eigenvalue",
        "elasticity",
        "expert_parallel",
        "graph_harvesting",
        "hybrid_engine",
        "managed_gradient_accumulation",
        "memory_breakdown",
        "nebula",
        "progressive_layer_drop",
        "quantize_training",
        "seq_parallel_comm_data_type",
        "seq_parallel_communication_data_type",
        "sparse_attention",
        "sparse_gradients",
        "timers",
        "torch_autocast",
        "use_data_before_expert_parallelism",
        "vocabulary_size",
        "weight_quantization",
        "zero_allow_untested_optimizer",
        "zero_force_ds_cpu_optimizer",
        # --- optimizer, checkpoint, NVMe I/O
        "aio.use_gds",
        "checkpoint.writer",
        "optimizer.legacy_fusion",
        # --- precision
        "fp16.fused_mode",
        "fp16.fp16_master_weights_and_grads",
        "bf16.immediate_grad_update",
        "bf16.check_grad_overflow",
        "bf16.bf16_master_weights_and_grads",
        "bf16.bf16_optimizer_states",
        # --- ZeRO: ZeRO++, MiCS, ZenFlow, stage-3 tuning knobs and legacy switches
        "zero_optimization.compute_grad_norm",
        "zero_optimization.cpu_offload_use_pin_memory",
        "zero_optimization.elastic_checkpoint",
        "zero_optimization.enable_sanity_checks",
        "zero_optimization.leaf_module",
        "zero_optimization.legacy_stage1",
        "zero_optimization.load_from_fp32_weights",
        "zero_optimization.log_trace_cache_warnings",
        "zero_optimization.memory_efficient_linear",
        "zero_optimization.mics_hierarchical_params_gather",
        "zero_optimization.mics_shard_size",
        "zero_optimization.override_module_apply",
        "zero_optimization.parameter_alignment",
        "zero_optimization.pipeline_loading_checkpoint",
        "zero_optimization.save_muon_momentum_buffer_in_memory",
        "zero_optimization.stage3_allgather_sequential",
        "zero_optimization.allgather_sequential",
        "zero_optimization.stage3_model_persistence_threshold",
        "zero_optimization.model_persistence_threshold",
        "zero_optimization.stage3_module_granularity_threshold",
        "zero_optimization.module_granularity_threshold",
        "zero_optimization.stage3_partition_stream_chunk_size",
        "zero_optimization.partition_stream_chunk_size",
        "zero_optimization.stage3_use_all_reduce_for_fetch_params",
        "zero_optimization.use_all_reduce_for_fetch_params",
        "zero_optimization.use_multi_rank_bucket_allreduce",
        "zero_optimization.zenflow",
        "zero_optimization.zero_quantized_nontrainable_weights",
        "zero_optimization.zeropp_loco_param",
        "zero_optimization.offload_optimizer.pipeline_read",
        "zero_optimization.offload_optimizer.pipeline_write",
        "zero_optimization.offload_optimizer.super_offload",
        "zero_optimization.offload_optimizer.convert_grad_on_cpu",
        "zero_optimization.offload_optimizer.cpuadam_cores_perc",
    }
)


def unused_children(path: str) -> set[str]:
    """Names of accepted-but-unused keys directly under `path` ("" for the top level)."""
    prefix = f"{path}." if path else ""
    return {
        key[len(prefix) :]
        for key in ACCEPTED_UNUSED
        if key.startswith(prefix) and "." not in key[len(prefix) :]
    }
