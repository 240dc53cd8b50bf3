"""Turning user state and RNG states into JSON plus named tensors, and back.

Nothing here pickles: a value that is neither JSON nor a tensor is refused with a message
that names where it sits in the structure.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from meshspeed.checkpoint.errors import CheckpointError

_TENSOR = "__tensor__"  # marks a tensor stored in the checkpoint's client tensor file


def encode_client_state(state: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """(JSON value, tensors by key). Tensors and numpy arrays are replaced by references."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(value: Any, where: str) -> Any:
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, np.generic):
            return value.item()
        if isinstance(value, (torch.Tensor, np.ndarray)):
            key = f"client/{len(tensors)}"
            t = torch.as_tensor(value).detach()
            tensors[key] = t.cpu().clone() if t.device.type != "cpu" else t.contiguous().clone()
            return {_TENSOR: key}
        if isinstance(value, dict):
            out = {}
            for k, v in value.items():
                if not isinstance(k, str):
                    raise CheckpointError(
                        f"client_state{where} has a key {k!r} of type {type(k).__name__}; JSON "
                        "keys are strings: convert the keys with str() before saving")
                if k == _TENSOR:
                    raise CheckpointError(f"client_state{where} uses the reserved key {_TENSOR!r}; rename it")
                out[k] = walk(v, f"{where}[{k!r}]")
            return out
        if isinstance(value, (list, tuple)):  # tuples come back as lists
            return [walk(v, f"{where}[{i}]") for i, v in enumerate(value)]
        raise CheckpointError(
            f"client_state{where} is a {type(value).__module__}.{type(value).__qualname__}; "
            "checkpoints hold only JSON values (dict with str keys, list, str, int, float, bool, "
            "None) and tensors, never pickles: convert it to one of those before saving")

    return walk(state, ""), tensors


def decode_client_state(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, dict):
        if set(value) == {_TENSOR}:
            return tensors[value[_TENSOR]]
        return {k: decode_client_state(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [decode_client_state(v, tensors) for v in value]
    return value


def client_tensor_keys(value: Any) -> list[str]:
    if isinstance(value, dict):
        if set(value) == {_TENSOR}:
            return [value[_TENSOR]]
        return [k for v in value.values() for k in client_tensor_keys(v)]
    if isinstance(value, list):
        return [k for v in value for k in client_tensor_keys(v)]
    return []


# -- random number generators -----------------------------------------------------------------
def capture_rng() -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """This process's RNG states: JSON (python, numpy) and tensors (torch CPU, CUDA)."""
    version, words, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    info: dict[str, Any] = {
        "python": [version, list(words), gauss],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
    }
    tensors = {"rng/torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng/cuda/{i}"] = state
        info["cuda_devices"] = torch.cuda.device_count()
    return info, tensors


def restore_rng(info: dict[str, Any], read: Any) -> None:
    """Set RNG states saved by capture_rng; `read(key)` returns a saved tensor."""
    version, words, gauss = info["python"]
    random.setstate((version, tuple(words), gauss))
    kind, keys, pos, has_gauss, cached = info["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(read("rng/torch_cpu"))
    n = info.get("cuda_devices", 0)
    if n and torch.cuda.is_available() and torch.cuda.device_count() == n:
        torch.cuda.set_rng_state_all([read(f"rng/cuda/{i}") for i in range(n)])
