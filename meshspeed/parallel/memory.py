"""Bytes resident on this rank, by category, counted from the tensors themselves.

Each storage is counted once, in the first category that names it, in the order of
`CATEGORIES`: a master tensor that aliases a parameter is a parameter, not a master.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

CATEGORIES = (
    "params",
    "gathered_params",
    "master_params",
    "grads",
    "optimizer_state",
    "comm_buffers",
)


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    s = t.untyped_storage()
    return (str(t.device), s.data_ptr())


def count_bytes(tensors_by_category: dict[str, Iterable[torch.Tensor | None]]) -> dict[str, int]:
    seen: set[tuple[str, int]] = set()
    out = {}
    for cat in CATEGORIES:
        total = 0
        for t in tensors_by_category.get(cat, ()):
            if t is None:
                continue
            nbytes = t.untyped_storage().nbytes()
            if nbytes == 0:
                continue
            key = _storage_key(t)
            if key in seen:
                continue
            seen.add(key)
            total += nbytes
        out[cat] = total
    return out


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
