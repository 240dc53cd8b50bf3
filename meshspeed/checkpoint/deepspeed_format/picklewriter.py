"""Writing DeepSpeed's `.pt` files: torch.save with a few of DeepSpeed's record classes.

DeepSpeed's checkpoint files are torch.save pickles, and some of what they hold are
instances of DeepSpeed's own classes (the loss scaler, the ZeRO stage enum, the fragment
addresses of `param_slice_mappings`). The exporter must write them so that DeepSpeed's
`torch.load(weights_only=False)` rebuilds those very classes, while meshspeed neither has
nor imports DeepSpeed.

Note [naming DeepSpeed's classes without importing them]
A stand-in (`DSObject`, `DSEnum`) carries the module and class name DeepSpeed uses and the
data. The pickler (pure-Python `pickle._Pickler`, handed to torch.save as its
`pickle_module`) writes a stand-in as the opcodes DeepSpeed's own save produces for the
real object: GLOBAL module/name, then NEWOBJ and BUILD with the instance's `__dict__` for
a plain object (what `object.__reduce_ex__(2)` gives), or REDUCE with the value for an
Enum (what `Enum.__reduce_ex__` gives). Only this writer knows the names; nothing here
ever resolves them, and reading them back is the other direction's restricted unpickler.
"""

from __future__ import annotations

import os
import pickle
import sys
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from meshspeed.checkpoint.atomic import write_with


@dataclass(frozen=True)
class DSObject:
    """An instance of DeepSpeed's class `module.name` whose `__dict__` is `state`."""

    module: str
    name: str
    state: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class DSEnum:
    """The member of DeepSpeed's Enum `module.name` with value `value`."""

    module: str
    name: str
    value: Any


def loss_scaler(cur_scale: float = 1.0) -> DSObject:
    """DeepSpeed's static LossScaler (fp32 and bf16 runs)."""
    return DSObject("deepspeed.runtime.fp16.loss_scaler", "LossScaler",
                    {"cur_scale": float(cur_scale), "dynamic": False})


def zero_stage(stage: int) -> DSEnum:
    return DSEnum("deepspeed.runtime.zero.config", "ZeroStageEnum", int(stage))


def fragment_address(numel: int, start: int) -> DSObject:
    """Where a parameter's piece lies in a rank's flat partition (`param_slice_mappings`)."""
    return DSObject("deepspeed.utils.tensor_fragment", "fragment_address",
                    {"numel": int(numel), "start": int(start)})


def _global(pickler: pickle._Pickler, module: str, name: str) -> None:
    pickler.write(pickle.GLOBAL + f"{module}\n{name}\n".encode())


def _save_object(pickler: pickle._Pickler, obj: DSObject) -> None:
    _global(pickler, obj.module, obj.name)
    pickler.save(())
    pickler.write(pickle.NEWOBJ)
    pickler.memoize(obj)
    pickler.save(dict(obj.state))
    pickler.write(pickle.BUILD)


def _save_enum(pickler: pickle._Pickler, obj: DSEnum) -> None:
    _global(pickler, obj.module, obj.name)
    pickler.save((obj.value,))
    pickler.write(pickle.REDUCE)
    pickler.memoize(obj)


class Pickler(pickle._Pickler):
    """pickle's Python pickler plus the stand-ins (torch.save subclasses it)."""

    dispatch: ClassVar[dict] = dict(pickle._Pickler.dispatch)
    dispatch[DSObject] = _save_object
    dispatch[DSEnum] = _save_enum


Unpickler = pickle.Unpickler  # torch.save never unpickles; present for a complete pickle_module
HIGHEST_PROTOCOL = pickle.HIGHEST_PROTOCOL


def save(obj: Any, path: str) -> int:
    """torch.save `obj` to `path` atomically (temp name, fsync, rename); returns the size."""
    write_with(path, lambda tmp: torch.save(obj, tmp, pickle_module=sys.modules[__name__], pickle_protocol=2))
    return os.path.getsize(path)
