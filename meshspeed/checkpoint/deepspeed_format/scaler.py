"""fp16's loss scaler written in DeepSpeed's terms (the export; the import's mapping is
to_meshspeed.py `scaler_state`).

Note [DeepSpeed's loss-scale counters]
meshspeed's dynamic scaler keeps `scale`, `hysteresis_left` (overflows still tolerated at
this scale) and `good_steps` (clean steps since the last overflow). DeepSpeed 0.19 keeps
`cur_scale`, `cur_hysteresis`, and two step counters: `cur_iter`, advanced on every
optimizer step (skipped ones too), and `last_overflow_iter`, the `cur_iter` of the last
overflow (-1: none yet). It grows the scale on a clean step when
`cur_iter - last_overflow_iter - 1` is a positive multiple of the window, which is
meshspeed's rule on `good_steps` (optim/loss_scaler.py). So the export writes
`cur_iter = global_steps` (what DeepSpeed's counter reads after as many steps) and
`last_overflow_iter = cur_iter - good_steps - 1`; the import reads `good_steps` back as
`cur_iter - last_overflow_iter - 1`, and the two round-trip exactly.

Where it goes: ZeRO 1-3 pickle the scaler object itself (`loss_scaler`, a
DynamicLossScaler carrying its whole configuration: DeepSpeed's load takes the object as
it is, so every attribute its `update_scale` reads is written). Stage 0's FP16_Optimizer
keeps the numbers as keys of its own state dict and has no hysteresis counter (it drops the
scale on every overflow), so `hysteresis_left` has nowhere to go there: DeepSpeed continues
without it, as its own runs do.
"""

from __future__ import annotations

from typing import Any

import torch

from meshspeed.checkpoint.deepspeed_format.picklewriter import DSObject

_MODULE = "deepspeed.runtime.fp16.loss_scaler"


def _fp16(meta: dict) -> dict[str, Any]:
    return (meta.get("config") or {}).get("fp16") or {}


def is_dynamic(meta: dict) -> bool:
    """An fp16 run with a dynamic scale (fp16.loss_scale 0, the default)."""
    return meta["layout"]["compute_dtype"] == "float16" and not _fp16(meta).get("loss_scale")


def counters(meta: dict) -> dict[str, Any]:
    """cur_scale, cur_iter and (dynamic) last_overflow_iter, cur_hysteresis (Note [DeepSpeed's
    loss-scale counters])."""
    saved = meta.get("loss_scaler") or {}
    scale = float(saved.get("scale", 1.0))
    cur_iter = int(meta["counters"]["global_steps"])
    if not is_dynamic(meta):
        return {"cur_scale": scale, "cur_iter": cur_iter}
    fp16 = _fp16(meta)
    return {"cur_scale": scale, "cur_iter": cur_iter,
            "last_overflow_iter": cur_iter - int(saved.get("good_steps", 0)) - 1,
            "cur_hysteresis": int(saved.get("hysteresis_left", fp16.get("hysteresis", 2)))}


def record(meta: dict) -> DSObject:
    """The scaler object ZeRO 1-3 pickle: DeepSpeed's static LossScaler (fp32, bf16, fp16 with
    a fixed scale) or its DynamicLossScaler."""
    c = counters(meta)
    if meta["layout"]["compute_dtype"] != "float16":
        return DSObject(_MODULE, "LossScaler", {"cur_scale": 1.0, "dynamic": False})
    if not is_dynamic(meta):
        return DSObject(_MODULE, "LossScaler", {"cur_scale": c["cur_scale"], "dynamic": False})
    fp16 = _fp16(meta)
    return DSObject(_MODULE, "DynamicLossScaler", {
        "cur_scale": c["cur_scale"], "dynamic": True, "cur_iter": c["cur_iter"],
        "last_overflow_iter": c["last_overflow_iter"], "scale_factor": 2.0,
        "scale_window": int(fp16.get("loss_scale_window", 1000)),
        "min_scale": fp16.get("min_loss_scale", 1), "delayed_shift": int(fp16.get("hysteresis", 2)),
        "cur_hysteresis": c["cur_hysteresis"],
        "consecutive_hysteresis": bool(fp16.get("consecutive_hysteresis", False)),
        "raise_error_at_min_scale": True, "dtype": torch.float16})


def stage0_keys(meta: dict) -> dict[str, Any]:
    """What stage 0's FP16_Optimizer keeps of the scaler in its state dict (fp16 runs)."""
    c = counters(meta)
    if not is_dynamic(meta):
        return {"dynamic_loss_scale": False, "cur_scale": c["cur_scale"], "cur_iter": c["cur_iter"]}
    return {"dynamic_loss_scale": True, "cur_scale": c["cur_scale"], "cur_iter": c["cur_iter"],
            "last_overflow_iter": c["last_overflow_iter"], "scale_factor": 2.0,
            "scale_window": int(_fp16(meta).get("loss_scale_window", 1000))}
