"""Memory tiers: the engine's byte counts split by where the bytes live.

`memory_breakdown()` counts each category (params, grads, master_params,
optimizer_state, ...) wherever its bytes are, and `tiers` splits the same total into
  "device": memory of the compute device,
  "host":   host memory holding offloaded state,
  "nvme":   swap files (their sizes on disk).
A tensor is host tier when the placement or the offloaded optimizer says so
(`host_tensors()`), or when it is in CPU memory while the compute device is an
accelerator. On a CPU-only machine everything else is device tier: the CPU is the
device there, and offloaded state is host tier only by placement (Note [offload on a
CPU-only machine] in placement.py).
"""

from __future__ import annotations

import torch

from meshspeed.offload.optimizer import OffloadOptimizer
from meshspeed.parallel.memory import CATEGORIES, optimizer_state_tensors
from meshspeed.process.accelerator import get_accelerator

TIERS = ("device", "host", "nvme")


def resident_state_tensors(optimizer) -> list[torch.Tensor]:
    """Optimizer state held in memory; an offloaded optimizer reports it without swapping
    anything in (iterating `state` of swapped state would read it all from disk)."""
    if isinstance(optimizer, OffloadOptimizer):
        return optimizer.memory_tensors()
    return optimizer_state_tensors(optimizer)


def add_tiers(out: dict, tensors: dict, strategy, optimizer) -> dict:
    """Add NVMe bytes to their categories and the `"tiers"` split to `out` (in place)."""
    offloaded = isinstance(optimizer, OffloadOptimizer)
    host = strategy.host_tensors() + (optimizer.host_tensors() if offloaded else [])
    host_keys = {_key(t) for t in host}
    cpu_device = get_accelerator().name == "cpu"
    tiers = dict.fromkeys(TIERS, 0)
    seen = set()
    for cat in CATEGORIES:
        for t in tensors.get(cat, ()):
            if t is None or t.untyped_storage().nbytes() == 0 or _key(t) in seen:
                continue
            seen.add(_key(t))
            on_host = _key(t) in host_keys or (t.device.type == "cpu" and not cpu_device)
            tiers["host" if on_host else "device"] += t.untyped_storage().nbytes()
    for nvme in (strategy.nvme_bytes(), optimizer.nvme_bytes() if offloaded else {}):
        for cat, nbytes in nvme.items():
            out[cat] = out.get(cat, 0) + nbytes
            tiers["nvme"] += nbytes
    out["total"] = sum(out[c] for c in CATEGORIES if c in out)
    out["tiers"] = tiers
    return out


def _key(t: torch.Tensor) -> tuple[str, int]:  # as in parallel/memory.py: one storage, one count
    return (str(t.device), t.untyped_storage().data_ptr())
