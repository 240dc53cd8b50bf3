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
  param_swap_buffers      offload_param.buffer_count x the 16-bit width x buffer_size,
                          or the largest unit shard when every shard is smaller (the
                          pool is sized at first use: Note [shards larger than a
                          staging buffer] in meshspeed/offload/param.py)
  gradient_staging        ZeRO's reduce-scatter staging pool: the largest unit outside
                          the blocks (one vocab x d_model matrix: the embedding or the
                          head, each a unit of its own, or both tied in the root unit;
                          Note [the root unit split] in meshspeed/parallel/zero/grouping.py)
                          and the two block units in flight, each whole plus its 1/dp
                          result, in the reduction dtype
  gathered_params         that vocab x d_model matrix (the tied root is whole for all of
                          forward and backward; untied, the embedding or the head is
                          whole around its own use) plus stage3_max_live_parameters + one
                          prefetch bucket of blocks (at least one block), 16-bit
  unit_gradient           the largest unit's reduced 16-bit shard,
                          with, on its way to the file, one master's span in fp32 (its
                          norm) and then its aligned 16-bit copy (Note [16-bit gradient
                          files] in meshspeed/offload/grad_files.py): counted as an fp32
                          copy of the whole shard, which bounds both
  writes_in_flight        2 x 256 MiB (Note [bounded writes in flight] in
                          meshspeed/offload/masters.py: published 16-bit ranges and
                          landed gradients)
  resident_state          the shards and optimizer sub-groups kept in memory
                          (offload_param / offload_optimizer max_in_cpu, elements:
                          16-bit width, and 12 bytes for a master and two moments)

plus the activations of one micro-batch. `tests/planner/test_offload.py` checks these
terms against `memory_breakdown()` of an engine, and `benchmarks/infinity.py` compares the
sum with the measured peak RSS (docs/benchmarks.md). Not counted: the interpreter and
torch themselves (about 0.25 GiB), heap fragmentation, and the build under `zero.Init`,
which holds this rank's 16-bit shards (2 x params / dp bytes) until `initialize` moves
them to their files unit by unit.

gradient_staging and gathered_params are on the accelerator (the estimate's "comm
buffers" row); the other four are host memory (its "offload buffers" row). On a CPU-only
machine both are RAM, as are the activations.

Note [a shape from the parameter count]
The buffers depend on the largest unit and parameter, so they need a model shape. Given
only a parameter count, `assumed_shape` picks the decoder a count like it usually has:
GPT-3 / Llama widths by size (2048 for 1-2.4B, 4096 for 4.5-10B, ...), head size 128,
vocabulary 32768, and as many blocks as make up the count (the 2B model of
docs/infinity.md comes out as its 37 blocks of width 2048). The estimate says so, and a
real shape (--layers/--d-model/--heads/--vocab) replaces it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from meshspeed.planner.activations import ModelShape, block_param_count, param_count

WRITES_IN_FLIGHT = 2 * (256 << 20)
FP32 = 4
ASSUMED_VOCAB = 32768
ASSUMED_HEAD_DIM = 128
# (parameters below, d_model): GPT-3's and Llama's widths by model size
_WIDTHS = ((2e8, 768), (5e8, 1024), (1e9, 1536), (2.4e9, 2048), (4.5e9, 2560), (1e10, 4096),
           (2e10, 5120), (4.5e10, 6656), (1e11, 8192), (3e11, 12288))


def root_param_count(shape: ModelShape) -> int:
    """Parameters outside the blocks: the embedding and, untied, the head."""
    return shape.vocab_size * shape.d_model * (1 if shape.tie_embeddings else 2)


def outer_unit_count(shape: ModelShape) -> int:
    """Parameters of the largest unit outside the blocks: one vocab x d_model matrix, tied
    or not (Note [the root unit split] in meshspeed/parallel/zero/grouping.py)."""
    return shape.vocab_size * shape.d_model


@dataclass(frozen=True)
class UnitSizes:
    """What the buffers depend on (Note [what an everything-on-NVMe rank holds]), in
    elements: every parameter outside the blocks (`root`), the largest unit outside the
    blocks (`outer`: the embedding's or the head's, or the tied root; Note [the root unit
    split] in meshspeed/parallel/zero/grouping.py), the largest block unit and how many
    blocks, and the largest parameter of each. `of_shape` reads them off a decoder's shape; initialize reads them
    off the model's stage-3 units (meshspeed/offload/auto.py)."""

    root: int
    block: int
    n_blocks: int
    root_param: int
    block_param: int
    outer: int = 0  # 0: the whole root is one unit (as before the split)

    @classmethod
    def of_shape(cls, shape: Any) -> UnitSizes:
        s = ModelShape.from_any(shape)
        return cls(root=root_param_count(s), block=block_param_count(s), n_blocks=s.n_layer,
                   root_param=s.vocab_size * s.d_model, block_param=s.ffn * s.d_model,
                   outer=outer_unit_count(s))

    @classmethod
    def of(cls, sizes: Any) -> UnitSizes:
        return sizes if isinstance(sizes, UnitSizes) else cls.of_shape(sizes)

    @property
    def largest_outer(self) -> int:
        return self.outer or self.root

    def largest_slice(self, dp: int) -> int:
        """A rank's largest slice of one parameter: a range boundary can leave a whole
        parameter in one rank's range, and a range is at most its unit's 1/dp."""
        return max(min(self.root_param, -(-self.largest_outer // dp)),
                   min(self.block_param, -(-self.block // dp)))


def nvme_host_buffers(shape, *, dp: int = 1, param_bytes: float = 2, comm_bytes: float = 4,
                      sub_group_size: int = 1_000_000_000, optimizer_buffer_count: int = 4,
                      param_buffer_count: int = 5, param_buffer_size: int = 100_000_000,
                      max_live_parameters: int = 1_000_000_000,
                      prefetch_bucket_size: int = 50_000_000, param_in_cpu: int = 0,
                      optimizer_in_cpu: int = 0) -> dict[str, int]:
    """Bytes per rank of each buffer of Note [what an everything-on-NVMe rank holds], for a
    ModelShape (or anything `ModelShape.from_any` takes) or a `UnitSizes`."""
    u = UnitSizes.of(shape)
    block, root, outer = u.block, u.root, u.largest_outer
    shard = -(-(root + u.n_blocks * block) // dp)
    largest_unit_shard = max(-(-outer // dp), -(-block // dp))
    sub_group = max(min(sub_group_size, shard), u.largest_slice(dp))
    in_flight = outer + min(2, u.n_blocks) * block
    live_blocks = min(u.n_blocks * block, max(block, max_live_parameters + prefetch_bucket_size))
    out = {
        "optimizer_swap_buffers": optimizer_buffer_count * sub_group * FP32,
        "param_swap_buffers": math.ceil(
            param_buffer_count * min(param_buffer_size, largest_unit_shard) * param_bytes),
        "gradient_staging": math.ceil(in_flight * (1 + 1 / dp) * comm_bytes),
        "gathered_params": math.ceil((outer + live_blocks) * param_bytes),
        "unit_gradient": math.ceil(largest_unit_shard * (param_bytes + FP32)),
        "writes_in_flight": WRITES_IN_FLIGHT,
    }
    if param_in_cpu or optimizer_in_cpu:  # offload_param / offload_optimizer max_in_cpu, elements
        out["resident_state"] = math.ceil(min(param_in_cpu, shard) * param_bytes
                                          + min(optimizer_in_cpu, shard) * 3 * FP32)
    out["total"] = sum(out.values())
    return out


def host_buffer_bytes(buffers: dict[str, int]) -> int:
    """The part of `nvme_host_buffers` in host memory (the rest is on the accelerator)."""
    return buffers["total"] - buffers.get("gradient_staging", 0) - buffers.get("gathered_params", 0)


def assumed_shape(num_params: float) -> ModelShape:
    """The decoder of Note [a shape from the parameter count] for `num_params`."""
    d = next((width for below, width in _WIDTHS if num_params < below), 16384)
    base = ModelShape(n_layer=1, d_model=d, n_head=d // ASSUMED_HEAD_DIM, vocab_size=ASSUMED_VOCAB)
    block = block_param_count(base)
    n_layer = max(1, round((num_params - (param_count(base) - block)) / block))
    return ModelShape(n_layer=n_layer, d_model=d, n_head=d // ASSUMED_HEAD_DIM,
                      vocab_size=ASSUMED_VOCAB)
