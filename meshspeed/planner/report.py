"""Human-readable tables for memory estimates (GB = 1e9 bytes, as in the ZeRO paper)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

from meshspeed.planner.activations import param_count

# (label, how to read the value from an estimate)
_ROWS = (
    ("params", lambda e: e["params"]),
    ("grads", lambda e: e["grads"]),
    ("optimizer states", lambda e: e["optimizer_states"]),
    ("model states (paper)", lambda e: e["model_states"]),
    ("activations", lambda e: e["activations"]),
    ("comm buffers", lambda e: e["comm_buffers"]),
    ("offload buffers (host)", lambda e: e.get("offload_buffers", 0)),
    ("total", lambda e: e["total"]),
    ("  on device", lambda e: e["tiers"]["device"]),
    ("  on host", lambda e: e["tiers"]["host"]),
    ("  on nvme", lambda e: e["tiers"]["nvme"]),
)
_SHAPE_FLAGS = "--layers/--d-model/--heads/--vocab/--seq-len"
_NOT_COUNTED = ("CUDA context", "allocator fragmentation", "temporaries")  # at the least


def format_gb(nbytes: float) -> str:
    """Bytes as GB, rounded half up like the paper: 3 significant figures below 100 GB, one
    decimal above, trailing zeros dropped (31.4, 41.3, 1.88, 7.5, 4187.5, 16000)."""
    gb = Decimal(math.ceil(nbytes)) / Decimal(10**9)  # exact for integer byte counts
    if gb == 0:
        return "0"
    step = Decimal("0.1") if abs(gb) >= 100 else Decimal(1).scaleb(gb.adjusted() - 2)
    text = f"{gb.quantize(step, rounding=ROUND_HALF_UP):f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def format_count(n: float) -> str:
    """A parameter count the way papers write it: 7.5B, 128B, 1T, 350M."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.4g}{unit}"
    return str(int(n))


def _header(e: Mapping[str, Any]) -> str:
    b = e["bytes_per_param"]
    parts = [
        f"{format_count(e['num_params'])} parameters",
        f"dp={e['dp']}",
        *([f"tp={e['tp']} ({format_count(e['num_params_per_tp_rank'])} per tp rank)"]
          if e.get("tp", 1) > 1 else []),
        f"bytes/param p={b['params']:g} g={b['grads']:g} K={b['optimizer_states']:g}",
    ]
    for key in ("offload_optimizer", "offload_param"):
        if e.get(key):
            parts.append(f"{key}={e[key]}")
    return ", ".join(parts) + " (GB = 1e9 bytes, per device)"


def format_report(estimate: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> str:
    """A table of one estimate, or of several side by side (e.g. one per stage; the header
    describes the first). Rows are the categories, columns the estimates."""
    estimates = [estimate] if isinstance(estimate, Mapping) else list(estimate)
    if not estimates:
        raise ValueError("format_report needs at least one estimate")
    heads = [f"stage {e['stage']} ({e['stage_name']})" for e in estimates]
    label_w = max(len(label) for label, _ in _ROWS)
    widths = [max(len(h), 8) for h in heads]
    lines = [_header(estimates[0]), ""]
    lines.append(" " * label_w + "".join(f"  {h:>{w}}" for h, w in zip(heads, widths)))
    for label, get in _ROWS:
        cells = "".join(f"  {format_gb(get(e)):>{w}}" for e, w in zip(estimates, widths))
        lines.append(f"{label:<{label_w}}{cells}")
    lines.append("(total = model states + activations + comm buffers + offload buffers "
                 "= on device + on host + on nvme)")
    for e in estimates:
        lines.extend(_infinity_lines(e))
    if all(e["activations"] == 0 for e in estimates):
        lines.append(f"activations: not estimated (give a model shape, micro batch and sequence "
                     f"length: {_SHAPE_FLAGS}, --micro-batch)")
    missing = dict.fromkeys(item for e in estimates for item in e.get("not_counted", _NOT_COUNTED))
    lines.append(f"Not counted: {', '.join(missing)} (see docs/memory.md).")
    return "\n".join(lines)


def in_memory_bytes(estimate: Mapping[str, Any]) -> int:
    """What a rank holds outside its files: the device and host tiers (both RAM when the
    devices are CPUs)."""
    return estimate["tiers"]["device"] + estimate["tiers"]["host"]


def _infinity_lines(e: Mapping[str, Any]) -> list[str]:
    """An NVMe optimizer (ZeRO-Infinity when the parameters are in files too): the bounded
    buffers that stay in memory, itemised, and the shape they were sized for when none was
    given."""
    buffers = e.get("detail", {}).get("offload_buffers")
    if not buffers:
        return []
    device = ("gradient_staging", "gathered_params")
    items = ", ".join(f"{k.replace('_', ' ')} {format_gb(v)}{' (device)' if k in device else ''}"
                      for k, v in buffers.items() if k != "total")
    if "gradient_staging" in buffers:  # ZeRO-Infinity: these buffers are all that is in memory
        acts = f" + activations {format_gb(e['activations'])}" if e["activations"] else ""
        out = [(f"in memory with everything on NVMe (stage {e['stage']}): "
                f"{format_gb(in_memory_bytes(e))} (on device + on host) = {items}{acts}")]
    else:
        out = [(f"host buffers of the NVMe optimizer (stage {e['stage']}, in \"offload buffers\"): "
                f"{format_gb(buffers['total'])} = {items}")]
    shape = e.get("assumed_shape")
    if shape:
        out.append(
            f"  buffers sized for an assumed shape from the parameter count: d_model "
            f"{shape['d_model']}, {shape['n_layer']} layers, {shape['n_head']} heads, vocab "
            f"{shape['vocab_size']} ({format_count(param_count(shape))} parameters); pass "
            f"{_SHAPE_FLAGS} for yours (and its activations)")
    return out


def format_table(rows: Sequence[Mapping[str, Any]], key: str = "model_states") -> str:
    """Rows from estimate_table as the paper's Table 1: one line per data-parallel degree,
    one column per stage, showing estimate[key] in GB; a dotted key reads nested values
    ("tiers.device")."""
    if not rows:
        raise ValueError("format_table needs at least one row")
    first = next(iter(rows[0]["stages"].values()))
    stages = list(rows[0]["stages"])
    heads = [f"stage {s} ({rows[0]['stages'][s]['stage_name']})" for s in stages]
    widths = [max(len(h), 8) for h in heads]
    title = _header(first).replace(f"dp={first['dp']}, ", "")
    lines = [f"{key} per device: {title}", ""]
    lines.append(f"{'N_d':>6}" + "".join(f"  {h:>{w}}" for h, w in zip(heads, widths)))
    for row in rows:
        cells = "".join(
            f"  {format_gb(_lookup(row['stages'][s], key)):>{w}}" for s, w in zip(stages, widths)
        )
        lines.append(f"{row['dp']:>6}{cells}")
    return "\n".join(lines)


def _lookup(estimate: Mapping[str, Any], key: str) -> Any:
    for part in key.split("."):
        estimate = estimate[part]
    return estimate
