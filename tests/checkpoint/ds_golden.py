"""Reading DeepSpeed-format .pt files without DeepSpeed, and describing their structure.

Shared by the export tests and by benchmarks/ds_checkpoint_export.py --write-golden (which
runs it on files DeepSpeed 0.19.8 itself wrote). Only torch and the standard library.
`load` maps DeepSpeed's record classes to inert `Record`s (anything else outside torch,
collections and builtins is refused); `describe` gives JSON: tensors as shape and dtype,
records as their class name and fields, containers recursively, plain values as they are.
"""

from __future__ import annotations

import pickle
import sys
from typing import Any

import torch

ALLOWED_DS = {
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
    ("deepspeed.utils.tensor_fragment", "fragment_address"),
}


class Record:
    """A DeepSpeed object read back as data: `ds_name`, `args` (Enum value), `state`."""

    ds_name = "?"

    def __init__(self, *args):
        self.args = args
        self.state = {}

    def __setstate__(self, state):
        self.args = ()
        self.state = state


class Unpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) in ALLOWED_DS:
            return type(name, (Record,), {"ds_name": f"{module}.{name}"})
        if module.startswith("deepspeed") or not (module.split(".")[0] in ("torch", "collections", "builtins", "_codecs")):
            raise pickle.UnpicklingError(f"refusing {module}.{name}")
        return super().find_class(module, name)


def load(path: str) -> Any:
    return torch.load(path, weights_only=False, pickle_module=sys.modules[__name__])


def describe(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return {"tensor": list(v.shape), "dtype": str(v.dtype).replace("torch.", "")}
    if isinstance(v, torch.Size):
        return {"size": list(v)}
    if isinstance(v, Record) or type(v).__module__.startswith("deepspeed"):
        name = v.ds_name if isinstance(v, Record) else f"{type(v).__module__}.{type(v).__name__}"
        if isinstance(v, Record):
            value = list(v.args) if v.args else describe(v.state)
        else:
            value = [int(v)] if isinstance(v, int) else describe(dict(vars(v)))
        return {"record": name, "value": value}
    if isinstance(v, dict):
        return {"dict": {str(k): describe(x) for k, x in v.items()},
                **({"int_keys": True} if v and all(isinstance(k, int) for k in v) else {})}
    if isinstance(v, (list, tuple)):
        return {type(v).__name__: [describe(x) for x in v]}
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return {"other": type(v).__name__}


def compare(want: Any, got: Any, path: str = "", skip: tuple[str, ...] = ()) -> list[str]:
    """Differences between two descriptions (floats within 1e-9 relative); `skip`: path prefixes."""
    if any(path.startswith(s) for s in skip):
        return []
    if isinstance(want, dict) and isinstance(got, dict):
        if set(want) != set(got):
            return [f"{path}: keys {sorted(want)} != {sorted(got)}"]
        out = []
        for k in want:
            out += compare(want[k], got[k], f"{path}.{k}" if path else k, skip)
        return out
    if isinstance(want, list) and isinstance(got, list):
        if len(want) != len(got):
            return [f"{path}: {len(want)} items != {len(got)}"]
        out = []
        for i, (a, b) in enumerate(zip(want, got)):
            out += compare(a, b, f"{path}[{i}]", skip)
        return out
    if isinstance(want, float) and isinstance(got, float) and not isinstance(got, bool):
        return [] if abs(want - got) <= 1e-9 * max(1.0, abs(want)) else [f"{path}: {want} != {got}"]
    if type(want) is not type(got) or want != got:
        return [f"{path}: {want!r} != {got!r}"]
    return []
