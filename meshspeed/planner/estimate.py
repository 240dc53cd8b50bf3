"""Memory per device for a ZeRO configuration: model states as in the ZeRO paper
(arXiv:1910.02054, Section V and Table 1), plus the activations and communication buffers the
paper's formula leaves out. Pure arithmetic: no torch, no processes. See docs/memory.md.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

from meshspeed.planner.activations import (
    ModelShape,
    activation_bytes,
    block_param_count,
    split_param_count,
)
from meshspeed.planner.offload import FP32, assumed_shape, host_buffer_bytes, nvme_host_buffers
from meshspeed.planner.report import format_report, format_table

__all__ = [
    "MODEL_STATES",
    "SHARDED",
    "STAGE_NAMES",
    "estimate_memory",
    "estimate_table",
    "format_report",
    "format_table",
    "not_counted",
    "valid_stages",
]

# The paper's names for the stages: P_os shards optimizer states, +g gradients, +p parameters.
STAGE_NAMES = {0: "DP", 1: "P_os", 2: "P_os+g", 3: "P_os+g+p"}
MODEL_STATES = ("params", "grads", "optimizer_states")
# Which model states each stage shards across the data-parallel group; the rest is replicated.
SHARDED: dict[int, frozenset[str]] = {
    0: frozenset(),
    1: frozenset({"optimizer_states"}),
    2: frozenset({"optimizer_states", "grads"}),
    3: frozenset({"optimizer_states", "grads", "params"}),
}
_TIER = {None: "device", "cpu": "host", "nvme": "nvme"}


def valid_stages(offload_optimizer: str | None = None, offload_param: str | None = None):
    """Stages that accept these offload settings (optimizer offload needs a sharded optimizer,
    parameter offload needs sharded parameters)."""
    if offload_param is not None:
        return (3,)
    return (1, 2, 3) if offload_optimizer is not None else (0, 1, 2, 3)


def estimate_memory(
    num_params: float,
    dp: int = 1,
    stage: int = 0,
    param_bytes: float = 2,
    grad_bytes: float = 2,
    optimizer_bytes: float = 12,
    *,
    offload_optimizer: str | None = None,
    offload_param: str | None = None,
    model_shape: Any = None,
    micro_batch_size: int | None = None,
    seq_len: int | None = None,
    activation_checkpointing: bool = False,
    overlap_comm: bool = True,
    reduce_bucket_size: int = 500_000_000,
    allgather_bucket_size: int = 500_000_000,
    prefetch_bucket_size: int = 50_000_000,
    max_live_parameters: int = 1_000_000_000,
    comm_dtype_bytes: float | None = None,
    tp: int = 1,
    sequence_parallel: bool = False,
    sub_group_size: int = 1_000_000_000,
    optimizer_buffer_count: int = 4,
    param_buffer_count: int = 5,
    param_buffer_size: int = 100_000_000,
    param_in_cpu: int = 0,
    optimizer_in_cpu: int = 0,
) -> dict[str, Any]:
    """Bytes per device for training num_params parameters with ZeRO `stage` over `dp` ranks.

    Bytes per parameter: param_bytes (working copy), grad_bytes, optimizer_bytes (K: for
    mixed-precision Adam the fp32 master weights, momentum and variance, 12). A sharded state
    holds ceil(num_params / dp) elements per rank (shards are padded to equal size).

    Returns a JSON-serialisable dict. "params", "grads", "optimizer_states" and their sum
    "model_states" are the paper's quantities wherever they live. "activations" is 0 when no
    model_shape is given (the memory is then not estimated, not zero). "comm_buffers" are the
    gradient buckets and, at stage 3, the gathered working parameters. "offload_buffers" are
    the host buffers of an NVMe optimizer (below; 0 otherwise). "total" is model_states +
    activations + comm_buffers + offload_buffers over all tiers; "tiers" splits it into
    "device" (what must fit on the accelerator), "host" and "nvme", and they sum to "total".
    "placement" maps each model state to its tier and "detail" itemises activations and
    buffers. "not_counted" lists what is counted nowhere (CUDA context, allocator
    fragmentation, temporaries, ...).

    offload_optimizer ("cpu" | "nvme", stage >= 1) moves optimizer states, and from stage 2
    the gradient shard the optimizer consumes, off the device, in fp32 (4 bytes): in host
    memory for "cpu" (Note [one gradient copy between steps] in meshspeed/offload/placement.py),
    in files for "nvme" (Note [gradients in their NVMe slot]), next to the fp32 masters.
    offload_param ("cpu" | "nvme", stage 3 only) moves parameter shards off the device;
    the device then holds only gathered working parameters. The allgather bucket is used
    after backward, when activations are freed, so it does not add to the peak and is
    accepted for symmetry with ZeRO configs only.

    tp: tensor-parallel degree. Each rank holds 1/tp of every split parameter (with a
    model_shape: the projections, embedding and head; without one, all num_params are
    taken as split) and the whole of the rest; ZeRO then shards that over `dp`:
    per rank, model states = K' x ceil((split/tp + replicated) / dp) for a sharded state.
    "num_params_per_tp_rank" is the count ZeRO works on.

    With offload_optimizer "nvme" (and tp 1), "detail"["offload_buffers"] itemises the
    bounded buffers that stand in for the swapped state (meshspeed/planner/offload.py,
    Note [what an everything-on-NVMe rank holds]), from `sub_group_size`,
    `optimizer_buffer_count` (offload_optimizer.buffer_count) and, with offload_param
    "nvme" too (ZeRO-Infinity: every model state on NVMe), `param_buffer_count` /
    `param_buffer_size` (offload_param's) and the stage-3 live-parameter limits. The swap
    buffers, the fp32 gradient copy and the writes in flight are host memory
    ("offload_buffers"); ZeRO-Infinity's gradient staging and gathered parameters are
    "comm_buffers" on the device. Without a model_shape the buffers are sized for
    `assumed_shape(num_params)` (Note [a shape from the parameter count]), returned as
    "assumed_shape"; activations are then not estimated.
    """
    del allgather_bucket_size  # Note in the docstring: not live at the activation peak.
    _check(num_params, dp, stage, offload_optimizer, offload_param)
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be an integer >= 1, got {tp!r}")
    total_psi = round(num_params)
    split = total_psi if model_shape is None else min(total_psi, split_param_count(model_shape))
    psi = -(-split // tp) + (total_psi - split)  # what one tp rank holds
    shard = -(-psi // dp)  # ceil, in integers
    # an offloaded optimizer consumes fp32 gradients: host buffers for "cpu" (Note [one
    # gradient copy between steps]); for "nvme" files in the training dtype (Note [16-bit
    # gradient files]), widened as the step reads them
    stored_grad_bytes = (param_bytes if offload_optimizer == "nvme" else FP32) \
        if offload_optimizer is not None and stage >= 2 else grad_bytes
    per_param = {"params": param_bytes, "grads": stored_grad_bytes, "optimizer_states": optimizer_bytes}
    states = {
        name: math.ceil((shard if name in SHARDED[stage] else psi) * nbytes)
        for name, nbytes in per_param.items()
    }
    placement = {
        "params": _TIER[offload_param],
        # NVMe optimizer offload writes the gradients to files (offload/grad_files.py)
        "grads": _TIER[offload_optimizer] if offload_optimizer is not None and stage >= 2 else "device",
        "optimizer_states": _TIER[offload_optimizer],
    }

    acts: dict[str, int] = {"total": 0}
    if model_shape is not None:
        if micro_batch_size is None or seq_len is None:
            raise ValueError("model_shape needs micro_batch_size and seq_len for activations")
        acts = activation_bytes(
            model_shape, micro_batch_size, seq_len, param_bytes, activation_checkpointing,
            tp=tp, sequence_parallel=sequence_parallel,
        )

    # Buffers live during backward, when activations peak: gradient buckets whenever
    # gradients leave the device (reduced across ranks or copied to an offloaded optimizer);
    # gathered working parameters whenever the device does not hold whole parameters.
    comm = {"reduce_buckets": 0, "gathered_params": 0}
    if dp > 1 or offload_optimizer is not None:
        comm["reduce_buckets"] = _reduce_buckets(
            psi, comm_dtype_bytes or grad_bytes, reduce_bucket_size, overlap_comm
        )
    if stage == 3 and (dp > 1 or offload_param is not None):
        comm["gathered_params"] = _gathered_params(
            psi, param_bytes, max_live_parameters, prefetch_bucket_size, model_shape
        )
    buffers = assumed = None
    infinity = stage == 3 and offload_optimizer == "nvme" and offload_param == "nvme"
    if infinity and tp != 1:
        raise ValueError("the ZeRO-Infinity buffer estimate assumes tp 1")
    if offload_optimizer == "nvme" and tp == 1:  # Note [what an everything-on-NVMe rank holds]
        if model_shape is None:  # Note [a shape from the parameter count]
            assumed = assumed_shape(total_psi)
        buffers = nvme_host_buffers(
            model_shape if assumed is None else assumed, dp=dp, param_bytes=param_bytes,
            comm_bytes=comm_dtype_bytes or FP32, sub_group_size=sub_group_size,
            optimizer_buffer_count=optimizer_buffer_count, param_buffer_count=param_buffer_count,
            param_buffer_size=param_buffer_size, max_live_parameters=max_live_parameters,
            prefetch_bucket_size=prefetch_bucket_size, param_in_cpu=param_in_cpu,
            optimizer_in_cpu=optimizer_in_cpu)  # Note [the residency budget]
        if infinity:
            comm = {"reduce_buckets": buffers["gradient_staging"],
                    "gathered_params": buffers["gathered_params"]}
        else:  # shards stay put and ZeRO's usual buffers move gradients: only the optimizer's
            buffers = _optimizer_only(buffers)
    comm["total"] = comm["reduce_buckets"] + comm["gathered_params"]

    model_states = sum(states.values())
    host_buffers = 0 if buffers is None else host_buffer_bytes(buffers)
    tiers = {"device": acts["total"] + comm["total"], "host": host_buffers, "nvme": 0}
    for name, tier in placement.items():
        tiers[tier] += states[name]
    return {
        "num_params": total_psi,
        "num_params_per_tp_rank": psi,
        "dp": dp,
        "tp": tp,
        "stage": stage,
        "stage_name": STAGE_NAMES[stage],
        "bytes_per_param": dict(per_param),
        "offload_optimizer": offload_optimizer,
        "offload_param": offload_param,
        **states,
        "model_states": model_states,
        "activations": acts["total"],
        "comm_buffers": comm["total"],
        "offload_buffers": host_buffers,
        "total": model_states + acts["total"] + comm["total"] + host_buffers,
        "tiers": tiers,
        "placement": placement,
        "detail": {"activations": acts, "comm_buffers": comm,
                   **({"offload_buffers": buffers} if buffers is not None else {})},
        **({"assumed_shape": dataclasses.asdict(assumed)} if assumed is not None else {}),
        "not_counted": not_counted(offload_optimizer, offload_param, itemised=buffers is not None),
    }


def _optimizer_only(buffers: dict[str, int]) -> dict[str, int]:
    """The host buffers of an NVMe optimizer whose parameters are not in files."""
    out = {k: buffers[k] for k in ("optimizer_swap_buffers", "unit_gradient", "writes_in_flight")}
    if "resident_state" in buffers:  # the optimizer's part only (its shards are not in files)
        out["resident_state"] = buffers["resident_state"]
    return out | {"total": sum(out.values())}


def not_counted(offload_optimizer: str | None, offload_param: str | None,
                itemised: bool = True) -> list[str]:
    """What an estimate with these offload settings leaves out, for its footer."""
    out = ["CUDA context", "allocator fragmentation", "temporaries"]
    if offload_optimizer is not None or offload_param is not None:
        out.append("the Python interpreter and torch in host memory (about 0.25 GiB a process)")
    if offload_optimizer == "nvme" and not itemised:
        out.append("the NVMe optimizer's swap buffers (offload_optimizer.buffer_count x "
                   "sub_group_size x 4 bytes) and up to 0.54 GB of writes in flight: itemised "
                   "only at tp 1")
    return out


def estimate_table(
    num_params: float,
    dps: Iterable[int] = (1, 4, 16, 64, 256, 1024),
    stages: Iterable[int] = (1, 2, 3),
    **kwargs: Any,
) -> list[dict[str, Any]]:
    """The paper's Table 1 layout: one row per data-parallel degree, one estimate per stage.

    Rows are {"dp": N, "stages": {stage: estimate_memory(...)}}; kwargs go to estimate_memory.
    """
    stages = tuple(stages)
    return [
        {"dp": n, "stages": {s: estimate_memory(num_params, n, s, **kwargs) for s in stages}}
        for n in dps
    ]


def _check(num_params, dp, stage, offload_optimizer, offload_param) -> None:
    if not num_params > 0:
        raise ValueError(f"num_params must be positive, got {num_params}")
    if not isinstance(dp, int) or dp < 1:
        raise ValueError(f"dp must be an integer >= 1, got {dp!r}")
    if stage not in SHARDED:
        raise ValueError(f"stage must be one of 0, 1, 2, 3, got {stage!r}")
    for name, value in (("offload_optimizer", offload_optimizer), ("offload_param", offload_param)):
        if value not in _TIER:
            raise ValueError(f"{name} must be None, 'cpu' or 'nvme', got {value!r}")
    if stage not in valid_stages(offload_optimizer, offload_param):
        if offload_param is not None:
            raise ValueError(
                f"offload_param needs stage 3 (parameters are only sharded there), got {stage}"
            )
        raise ValueError("offload_optimizer needs stage >= 1: at stage 0 every rank steps "
                         "the whole optimizer")


def _reduce_buckets(psi, comm_bytes, bucket_size, overlap_comm) -> int:
    """Gradients leave the device in buckets of bucket_size elements; with overlap one bucket
    fills while the previous one is in flight, so two exist."""
    return math.ceil((2 if overlap_comm else 1) * min(bucket_size, psi) * comm_bytes)


def _gathered_params(psi, param_bytes, max_live, prefetch, model_shape) -> int:
    """Stage 3 working parameters: at most max_live_parameters resident plus one prefetch
    bucket in flight, but a whole block (or the embedding) is gathered at once whatever the
    bounds say. Gathered copies are separate from the rank's own shard."""
    live = max_live + prefetch
    if model_shape is not None:
        s = ModelShape.from_any(model_shape)
        live = max(live, block_param_count(s), s.vocab_size * s.d_model)
    return math.ceil(min(live, psi) * param_bytes)
