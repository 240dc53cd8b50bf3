"""`deepspeed.checkpoint.utils`."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["clone_tensors_for_torch_save"]


def clone_tensors_for_torch_save(item: Any, device: torch.device | str = "cpu") -> Any:
    """`item` (a tensor, or lists, tuples and dicts of them) with every tensor detached and
    copied to `device`, so that `torch.save` writes each tensor's own bytes rather than the
    whole storage a view shares (accelerate's `get_state_dict` at ZeRO 0-2)."""
    if torch.is_tensor(item):
        return item.detach().clone().to(device)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    if isinstance(item, (list, tuple)):
        return type(item)(clone_tensors_for_torch_save(v, device) for v in item)
    return item
