"""The analytic cost of one candidate layout: bytes per rank and seconds per step.

Note [rank layout]
Ranks are numbered node by node, and the axes vary tp fastest, then cp, then ep (the
inner part of dp, as in meshspeed/topology/degrees.py: ep * edp == dp), then the rest of
dp, then pp: rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i. A group of `size` ranks
`stride` apart stays inside a node when stride * size <= gpus_per_node.

Note [overlap assumptions]
* Data-parallel traffic (gradient reduction, ZeRO-3 gathers) overlaps with compute up to
  `Hardware.overlap` times the compute it can hide under; the rest is exposed.
* Tensor-, context- and expert-parallel collectives sit between dependent matmuls and are
  fully exposed (no async tp); pipeline sends are exposed once per micro-batch.
* The pipeline bubble is (pp - 1) micro-batch slots of the 1F1B schedule:
  step = (m + pp - 1) x one micro-batch on one stage, so bubble/step = (pp-1)/(m+pp-1).
* The optimizer step on the device is not priced (memory-bound, small next to the rest);
  with offload, the PCIe copies and the host Adam are, and do not overlap.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from meshspeed.planner.activations import activation_bytes
from meshspeed.planner.estimate import estimate_memory
from meshspeed.planner.hardware import Hardware
from meshspeed.planner.model_spec import PlanModel

_BUCKET = 500_000_000  # zero_optimization.reduce_bucket_size's default, elements

# Note [buffers at the peak]
# Measured against meshspeed's engine (tests/planner/test_plan_measured.py):
# * stages 0-1: a rank's gradients are the flat buckets themselves, reduced in place; no
#   other buffer exists while activations peak.
# * stage 2: the flat gradient buffer of up to one reduce bucket, its 1/n reduced shard,
#   and, depending on when the asynchronous reduction runs against backward, one more
#   bucket-sized copy: measured peaks of the same step differ by exactly that (two runs,
#   4.24 MB and 4.80 MB for a 140k-parameter fp32 model), so it is counted.
# * stage 3: the units in flight (the largest outside the blocks -- the embedding or the
#   head, or both tied in the root unit: one vocab x d_model matrix -- and two blocks),
#   each with its gradient staging (whole + 1/n, as in offload.py) and its gathered
#   16-bit working copy; with checkpointing one more gathered block (the recomputed
#   forward's), seen as up to 0.46 MB more at the peak of a 2-layer model, depending
#   on timing.
# Activation temporaries (a matmul's output before the next op consumes it) are not
# counted: the headroom fraction covers them and fragmentation.

PRECISION = {  # bytes per parameter: (param, grad, optimizer), and activations
    "bf16": (2, 2, 12, 2), "fp16": (2, 2, 12, 2), "fp32": (4, 4, 8, 4),
}


@dataclass(frozen=True)
class Candidate:
    """One layout: parallel degrees (tp * cp * dp * pp == gpus; ep divides dp), ZeRO
    stage, optimizer offload, activation checkpointing and the batch split."""

    dp: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    stage: int = 0
    offload: str | None = None  # optimizer offload: None or "cpu"
    checkpointing: bool = False
    micro_batch: int = 1
    grad_accum: int = 1
    sequence_parallel: bool = True  # Megatron sp when tp > 1 (same traffic, less memory)

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def splits_sequence_over_tp(self) -> bool:
        """Megatron's sequence parallelism is on: tp > 1 and no context parallelism, which
        splits the sequence itself (the composition table refuses both together)."""
        return self.sequence_parallel and self.tp > 1 and self.cp == 1

    def strides(self) -> dict[str, tuple[int, int]]:
        """(stride, size) of each axis' groups, Note [rank layout]."""
        t, c, e = self.tp, self.cp, self.ep
        return {"tp": (1, t), "cp": (t, c), "ep": (t * c, e), "dp": (t * c, self.dp),
                "dp_cp": (t, c * self.dp), "edp": (t * c * e, self.dp // e),
                "pp": (t * c * self.dp, self.pp)}

    def label(self) -> str:
        parts = [f"dp{self.dp}"] + [f"{k}{v}" for k, v in
                                    (("tp", self.tp), ("pp", self.pp), ("cp", self.cp), ("ep", self.ep)) if v > 1]
        parts.append(f"zero{self.stage}")
        if self.offload:
            parts.append(f"offload-{self.offload}")
        if self.checkpointing:
            parts.append("ckpt")
        parts.append(f"mb{self.micro_batch}x{self.grad_accum}")
        return " ".join(parts)


def rank_params(model: PlanModel, c: Candidate) -> tuple[int, int]:
    """(dense, expert) parameters on the most loaded rank: 1/tp of every split weight, the
    layers of one pipeline stage, the embedding on the first stage and the head (and final
    norm) on the last; the expert layers' 1/ep of experts, also split by tp."""
    s, d = model.shape, model.shape.d_model
    per_stage = s.n_layer // c.pp
    moe_per_stage = math.ceil(model.moe_layers / c.pp)
    norms = 2 * d

    def block(moe: bool) -> int:
        return (model.dense_block_params(moe) - norms) // c.tp + norms

    layers = (per_stage - moe_per_stage) * block(False) + moe_per_stage * block(True)
    vocab = -(-s.vocab_size * d // c.tp)
    first = layers + vocab
    last = layers + (0 if s.tie_embeddings and c.pp == 1 else vocab) + d
    dense = first + last - layers if c.pp == 1 else max(first, last)
    expert = moe_per_stage * model.expert_params_per_layer() // (c.ep * c.tp)
    return dense, expert


def memory(model: PlanModel, c: Candidate, seq_len: int, precision: str = "bf16",
           headroom: float = 0.1) -> dict[str, float]:
    """Device bytes per rank, by part. `headroom` is the fraction of the device kept for
    the allocator's fragmentation and temporaries ("headroom" = that fraction of the sum
    of the rest / (1 - headroom)); "total" includes it."""
    pb, gb, ob, ab = PRECISION[precision]
    dense, expert = rank_params(model, c)
    out = {"params": 0.0, "grads": 0.0, "optimizer": 0.0}
    for psi, group in ((dense, c.dp * c.cp), (expert, c.dp // c.ep * c.cp)):
        if psi == 0:
            continue
        est = estimate_memory(psi, group, c.stage, pb, gb, ob, offload_optimizer=c.offload)
        for part, key in (("params", "params"), ("grads", "grads"), ("optimizer", "optimizer_states")):
            if est["placement"][key] == "device":
                out[part] += est[key]
    buffers = _buffers(model, c, pb, gb, dense)
    out["activations"] = _activations(model, c, seq_len, ab)
    tokens = c.micro_batch * seq_len // c.cp
    if c.pp > 1:  # a received and a sent activation (and their gradients) in flight
        buffers += 4 * tokens * model.shape.d_model * ab
    out["buffers"] = buffers
    used = sum(out.values())
    out["headroom"] = used * headroom / (1 - headroom)
    out["total"] = used + out["headroom"]
    return out


def _buffers(model: PlanModel, c: Candidate, pb: int, gb: int, dense: int) -> float:
    """Communication buffers live at the activation peak, as meshspeed's engine keeps them
    (Note [buffers at the peak])."""
    n = c.dp * c.cp
    if c.stage <= 1 or n == 1:
        return 0.0
    if c.stage == 2:
        return gb * min(dense, _BUCKET) * (2 + 1 / n)
    s = model.shape
    root = -(-s.vocab_size * s.d_model // c.tp)  # Note [the root unit split] (zero/grouping.py)
    block = model.dense_block_params(False) // c.tp
    in_flight = min(2, s.n_layer // c.pp)
    staging = min(root + in_flight * block, dense)
    # recomputation gathers a block again while backward's copy of the next is alive
    gathered = min(root + in_flight * block, dense) + (block if c.checkpointing else 0)
    return staging * gb * (1 + 1 / n) + gathered * pb


def _activations(model: PlanModel, c: Candidate, seq_len: int, ab: int) -> float:
    """The activation peak of the most loaded stage (activations.py's formula for one
    micro-batch of the stage's layers and mb x S/cp tokens). Under 1F1B the first stage
    holds min(pp, m) micro-batches; the last holds one plus the logits."""
    s = model.shape
    per_stage = s.n_layer // c.pp
    shape = dataclasses.replace(s, n_layer=per_stage)
    a = activation_bytes(shape, c.micro_batch, seq_len // c.cp, ab, c.checkpointing,
                         tp=c.tp, sequence_parallel=c.splits_sequence_over_tp)
    if c.pp == 1:
        return a["total"]
    first = min(c.pp, c.grad_accum) * a["layers"] + a["token_ids"]
    return max(first, a["total"])


def step_time(model: PlanModel, c: Candidate, hw: Hardware, global_batch: int, seq_len: int,
              precision: str = "bf16") -> dict[str, float]:
    """Seconds per optimizer step, by part: "compute", "bubble", "tp", "cp", "ep", "pp",
    "dp" (exposed traffic of each axis), "offload"; "total" is their sum; "dp_hidden" is the
    data-parallel traffic hidden under compute (not in the total).
    Note [overlap assumptions]."""
    pb, gb, _, ab = PRECISION[precision]
    s, d = model.shape, model.shape.d_model
    m = c.grad_accum
    strides = c.strides()

    def link(axis):
        return hw.link(*strides[axis])

    # compute: the job's FLOPs spread evenly over the ranks
    flops = model.train_flops_per_token(seq_len, c.checkpointing) * global_batch * seq_len
    compute = flops / c.world / hw.flops
    layers = s.n_layer // c.pp
    compute += hw.layer_overhead * layers * m * (4 if c.checkpointing else 3) / 3
    per_micro = compute / m  # one micro-batch on one stage

    tokens = c.micro_batch * seq_len // c.cp  # per rank per micro-batch
    act = tokens * d * ab
    t = dict.fromkeys(("compute", "bubble", "tp", "cp", "ep", "pp", "dp", "offload"), 0.0)
    t["compute"] = compute
    # tp (Megatron): 2 all-reduces per block forward, 2 backward, 2 more to recompute;
    # with sp each is an all-gather + reduce-scatter of the same volume. Embedding: 1+1.
    n_ar = layers * (4 + (2 if c.checkpointing else 0)) + 2
    t["tp"] = m * n_ar * link("tp").ring(c.tp, act, 2)
    # cp (Ulysses, arXiv:2309.14509): q, k, v and the output change layout forward, and
    # their gradients backward: 4 + 4 all-to-alls of the local activation per block
    kv = 2 * s.kv_dim / s.d_model
    a2a = (2 + kv) * link("cp").ring(c.cp, act / c.tp)
    t["cp"] = m * layers * 2 * a2a * (1.5 if c.checkpointing else 1)
    # ep: dispatch and combine forward, and both again backward, top_k copies per token
    moe_layers = math.ceil(model.moe_layers / c.pp)
    t["ep"] = m * moe_layers * 4 * link("ep").ring(c.ep, act * model.top_k)
    # pp: one activation forward and one gradient backward per micro-batch boundary
    if c.pp > 1:
        t["pp"] = m * 2 * link("pp").p2p(act / (c.tp if c.splits_sequence_over_tp else 1))
        t["bubble"] = (c.pp - 1) * (per_micro + (t["tp"] + t["cp"] + t["ep"]) / m)
    t["dp"], t["offload"], hidden = _dp_time(model, c, hw, pb, gb, compute)
    t["total"] = sum(t.values())
    t["dp_hidden"] = hidden  # not in the total: breaks ties toward less traffic
    return t


def _dp_time(model, c, hw, pb, gb, compute) -> tuple[float, float, float]:
    """Exposed data-parallel traffic, offload time, and the hidden traffic, per step.

    stage 0-1: one all-reduce of the gradients per step (stage 1: reduce-scatter +
    all-gather, the same volume); stage 2: a reduce-scatter per micro-batch and one
    all-gather of the updated shard; stage 3: per micro-batch an all-gather in forward,
    one in backward and a reduce-scatter (the ZeRO paper's 1.5x, times m), and one more
    all-gather with activation checkpointing (the recomputed forward needs the block's
    parameters again: measured on meshspeed's engine, tests/planner/test_plan_measured.py)."""
    dense, expert = rank_params(model, c)
    strides = c.strides()
    m = c.grad_accum
    total = 0.0
    for psi, axis in ((dense, "dp_cp"), (expert, "edp")):
        stride, n = strides[axis]
        if n <= 1 or psi == 0:
            continue
        ln = hw.link(stride, n)
        g, p = psi * gb, psi * pb
        if c.stage <= 1:
            total += ln.ring(n, g, 2)
        elif c.stage == 2:
            total += m * ln.ring(n, g) + ln.ring(n, p)
        else:  # one collective per unit (a block, and the root); recomputation gathers again
            units = model.shape.n_layer // c.pp + 1
            total += m * units * ((3 if c.checkpointing else 2) * ln.ring(n, p / units)
                                  + ln.ring(n, g / units))
    exposed = total - hw.overlap * min(total, compute)
    offload = 0.0
    if c.offload:
        shard = (dense / (c.dp * c.cp)) + expert / max(1, c.dp // c.ep * c.cp)
        offload = shard * (gb + pb) / hw.pcie + shard / hw.cpu_adam
    return exposed, offload, total - exposed
