"""Host memory of a ZeRO-Infinity rank: the bounded buffers that stand in for the model.

Note [what an everything-on-NVMe rank holds]
With ZeRO stage 3, `offload_optimizer` and `offload_param` both on "nvme", every model
state is in files (docs/infinity.md): 16-bit shards, fp32 masters, Adam's moments and the
reduced gradients. What stays in memory is a set of buffers whose sizes come from the
config and from the largest unit and parameter, not from the model's size:

  optimizer_swap_buffers  offload_optimizer.buffer_count x the largest optimizer
                          sub-group (sub_group_size elements, or one parameter's slice
                          when that is larger: parameters are never split; a slice is
                          at most its unit's 1/dp, and can be the whole parameter) x 4 bytes
  param_swap_buffers      offload_param.buffer_count x buffer_size x the 16-bit width
  gradient_staging        ZeRO's reduce-scatter staging pool: the root unit and the two
                          block units in flight, each whole plus its 1/dp result, in
                          the reduction dtype
  gathered_params         the root unit (embedding + head: whole for all of forward and
                          backward) plus stage3_max_live_parameters + one prefetch bucket
                          of blocks (at least one block), 16-bit
  unit_gradient           the root unit's reduced 16-bit shard and its fp32 copy on its
                          way to the file (the largest single gradient copy)
  writes_in_flight        2 x 256 MiB (Note [bounded writes in flight] in
                          meshspeed/offload/masters.py: published 16-bit ranges and
                          landed gradients)

plus the activations of one micro-batch. `tests/planner/test_offload.py` checks these
terms against `memory_breakdown()` of an engine, and `benchmarks/infinity.py` compares the
sum with the measured peak RSS (docs/benchmarks.md). Not counted: the interpreter and
torch themselves (about 0.25 GiB), heap fragmentation, and the build under `zero.Init`,
which holds this rank's 16-bit shards (2 x params / dp bytes) until `initialize` moves
them to their files unit by unit.
"""

from __future__ import annotations

import math

from meshspeed.planner.activations import ModelShape, block_param_count

WRITES_IN_FLIGHT = 2 * (256 << 20)
FP32 = 4


def root_param_count(shape: ModelShape) -> int:
    """Parameters of the root unit: the embedding and, untied, the head."""
    return shape.vocab_size * shape.d_model * (1 if shape.tie_embeddings else 2)


def nvme_host_buffers(shape, *, dp: int = 1, param_bytes: float = 2, comm_bytes: float = 4,
                      sub_group_size: int = 1_000_000_000, optimizer_buffer_count: int = 4,
                      param_buffer_count: int = 5, param_buffer_size: int = 100_000_000,
                      max_live_parameters: int = 1_000_000_000,
                      prefetch_bucket_size: int = 50_000_000) -> dict[str, int]:
    """Bytes per rank of each buffer of Note [what an everything-on-NVMe rank holds]."""
    s = ModelShape.from_any(shape)
    block, root = block_param_count(s), root_param_count(s)
    shard = -(-(root + s.n_layer * block) // dp)
    # a rank's range of a unit can hold a whole parameter (where the range boundaries fall),
    # so its largest slice is at most the parameter and at most its unit's 1/dp
    largest_slice = max(min(s.vocab_size * s.d_model, -(-root // dp)),
                        min(s.ffn * s.d_model, -(-block // dp)))
    sub_group = max(min(sub_group_size, shard), largest_slice)
    in_flight = root + min(2, s.n_layer) * block
    live_blocks = min(s.n_layer * block, max(block, max_live_parameters + prefetch_bucket_size))
    out = {
        "optimizer_swap_buffers": optimizer_buffer_count * sub_group * FP32,
        "param_swap_buffers": math.ceil(param_buffer_count * param_buffer_size * param_bytes),
        "gradient_staging": math.ceil(in_flight * (1 + 1 / dp) * comm_bytes),
        "gathered_params": math.ceil((root + live_blocks) * param_bytes),
        "unit_gradient": math.ceil(-(-root // dp) * (param_bytes + FP32)),
        "writes_in_flight": WRITES_IN_FLIGHT,
    }
    out["total"] = sum(out.values())
    return out
