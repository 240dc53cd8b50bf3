"""Reading DeepSpeed's `torch.save` files without running any code from them.

    state = load_torch_file(path)      # tensors (on CPU, memory-mapped), containers, values

DeepSpeed's checkpoint files are pickles in torch's zip format. A pickle names the
globals (classes and functions) it needs and calls them while it loads, so an ordinary
`torch.load` of a file someone handed you can run anything. Here every global the pickle
asks for goes through `_Restricted.find_class`, which answers only from `_ALLOWED`: what
torch needs to rebuild tensors, a few harmless builtins, and DeepSpeed's own record
classes, each mapped to inert data. Anything else raises CheckpointError naming the file
and the global, before anything is imported (Note [an allowlist, per call]).
"""

from __future__ import annotations

import _compat_pickle
import os
import pickle
import types
import zipfile
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from meshspeed.checkpoint.errors import CheckpointError


class DeepSpeedRecord(dict):
    """An instance of one of DeepSpeed's record classes, as a plain dict of its attributes
    (`qualname`: the class it was, e.g. "deepspeed.runtime.fp16.loss_scaler.LossScaler").
    It has no behaviour: unpickling fills it (`__setstate__`) and nothing else."""

    qualname = ""

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (__dict__, __slots__ values)
            for part in state:
                if isinstance(part, dict):
                    self.update(part)
        elif isinstance(state, dict):
            self.update(state)
        else:
            raise pickle.UnpicklingError(f"{self.qualname} has an unexpected state {type(state).__name__}")


def _record(qualname: str) -> type:
    return type(qualname.rsplit(".", 1)[1], (DeepSpeedRecord,), {"qualname": qualname})


def _enum_value(qualname: str) -> Callable[[Any], int]:
    def value(v: Any) -> int:  # an IntEnum member pickles as a call of its class with the value
        if not isinstance(v, int):
            raise pickle.UnpicklingError(f"{qualname}({v!r}): expected an int value")
        return int(v)
    return value


def _rebuild_tensor(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None,
                    metadata=None):
    """torch's tensor rebuild, refusing what a plain saved tensor never has (hooks)."""
    if not isinstance(storage, torch.storage.TypedStorage):
        raise pickle.UnpicklingError(f"a tensor rebuilt from a {type(storage).__name__}, not a storage")
    if backward_hooks:
        raise pickle.UnpicklingError("a tensor with backward hooks")
    t = torch._utils._rebuild_tensor(storage, storage_offset, size, stride)
    return t  # requires_grad and metadata are dropped: checkpoint data, not autograd state


def _rebuild_parameter(data, requires_grad=False, backward_hooks=None, *rest):
    if not isinstance(data, torch.Tensor) or backward_hooks:
        raise pickle.UnpicklingError("a parameter that is not a plain tensor")
    return data  # a Parameter's data: the checkpoint wants values


class _TensorType:
    """Stands for `torch.Tensor` as the target type of `_rebuild_from_type_v2` (ZeRO-3's
    flat groups are saved through it); not callable, so it cannot build anything."""


def _rebuild_from_type(func, new_type, args, state):
    """torch's rebuild of a tensor (sub)class: only a plain tensor. Python attributes set
    on it (DeepSpeed tags ZeRO-3 groups with `ds_id`) are dropped: plain values only."""
    if func not in (_rebuild_tensor, _rebuild_parameter) or new_type is not _TensorType:
        raise pickle.UnpicklingError("a tensor subclass")
    for part in state if isinstance(state, tuple) else (state,):
        if part and not (isinstance(part, dict) and all(
                isinstance(v, (str, int, float, bool, type(None))) for v in part.values())):
            raise pickle.UnpicklingError("a tensor with state other than plain attributes")
    return func(*args)


def _latin1(text: Any, encoding: str = "latin1") -> bytes:
    """`_codecs.encode`, which protocol 2 uses for bytes objects; latin-1 only."""
    if not isinstance(text, str) or encoding.replace("-", "").lower() != "latin1":
        raise pickle.UnpicklingError(f"_codecs.encode with encoding {encoding!r}")
    return text.encode("latin1")


def _torch_dtypes() -> dict[tuple[str, str], Any]:
    return {("torch", name): getattr(torch, name) for name in dir(torch)
            if isinstance(getattr(torch, name, None), torch.dtype)}


# Note [an allowlist, per call]
# torch.load(weights_only=True) has its own allowlist, but extending it
# (`torch.serialization.add_safe_globals`, or its `safe_globals` context manager) changes
# a process-wide set: another thread loading at the same time would see DeepSpeed's names
# allowed too. So the allowlist is ours and lives in the unpickler `torch.load` is handed
# (`pickle_module=`), made afresh for each file (it carries the file name for the error).
# torch's own wrapper answers storage types ("FloatStorage") before asking ours; the rest
# comes here. The entries are either the harmless callable itself or a stand-in: DeepSpeed's
# classes are not imported (DeepSpeed need not be installed) but replaced by
# DeepSpeedRecord subclasses (filled with the object's attributes, no methods run) or,
# for its int enums, by a function returning the int. Found in the files DeepSpeed 0.19.8
# writes (benchmarks/ds_checkpoint_import.py makes them): model states, ZeRO 1/2/3 and bf16
# optimizer states, pipeline layer files, universal checkpoint files.
_RECORDS = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.utils.tensor_fragment.fragment_address",
    "argparse.Namespace",
)
_ENUMS = (
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.runtime.zero.partition_parameters.ZeroParamStatus",
)
_ALLOWED: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type,
    ("torch", "Tensor"): _TensorType,
    ("torch", "Size"): torch.Size,
    ("torch", "device"): torch.device,
    ("collections", "OrderedDict"): OrderedDict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "complex"): complex,
    ("builtins", "slice"): slice,
    ("_codecs", "encode"): _latin1,
    **{tuple(q.rsplit(".", 1)): _record(q) for q in _RECORDS},
    **{tuple(q.rsplit(".", 1)): _enum_value(q) for q in _ENUMS},
}


def refusal(path: str, module: str, name: str) -> CheckpointError:
    return CheckpointError(
        f"refusing to load {path}: its pickle asks for {module}.{name}, which is not a tensor, "
        "container, plain value or DeepSpeed record class, so loading it could run code from the "
        "file; only load checkpoints you trust, and convert them with a DeepSpeed you trust")


def _pickle_module(path: str) -> types.ModuleType:
    """A pickle module whose unpickler allows only `_ALLOWED`, for `torch.load`."""
    dtypes = _torch_dtypes()

    class _Restricted(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            # protocol 2 names Python 2's modules (`__builtin__.set`), as pickle maps them
            if (module, name) in _compat_pickle.NAME_MAPPING:
                module, name = _compat_pickle.NAME_MAPPING[(module, name)]
            module = _compat_pickle.IMPORT_MAPPING.get(module, module)
            found = _ALLOWED.get((module, name), dtypes.get((module, name)))
            if found is None:
                raise refusal(path, module, name)
            return found

    mod = types.ModuleType("meshspeed_restricted_pickle")
    mod.Unpickler = _Restricted  # type: ignore[attr-defined]
    mod.load = lambda f, **kw: _Restricted(f, **kw).load()  # type: ignore[attr-defined]
    mod.UnpicklingError = pickle.UnpicklingError  # type: ignore[attr-defined]
    return mod


def _check_zip(path: str) -> None:
    """torch's zip format only: the legacy formats and TorchScript archives take other
    paths through torch.load (TorchScript runs code), and DeepSpeed writes neither."""
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} does not exist; the DeepSpeed checkpoint is incomplete")
    if not zipfile.is_zipfile(path):
        raise CheckpointError(f"{path} is not a torch.save file in torch's zip format (the only "
                              "format DeepSpeed writes); refusing to read it")
    with zipfile.ZipFile(path) as z:
        names = z.namelist()
    if any(n.endswith("/constants.pkl") or "/code/" in n for n in names):
        raise CheckpointError(f"{path} is a TorchScript archive, not a DeepSpeed checkpoint file; "
                              "refusing to load it")
    if not any(n.endswith("data.pkl") for n in names):
        raise CheckpointError(f"{path} is a zip file without torch's data.pkl: not a torch.save file")


def load_torch_file(path: str | os.PathLike, mmap: bool = True) -> Any:
    """The object a DeepSpeed `torch.save` file holds, read with the allowlist (tensors on
    CPU; memory-mapped when `mmap`, so only what is used is read). A global outside the
    allowlist raises CheckpointError naming the file and the global; nothing from the file
    runs."""
    path = os.fspath(path)
    _check_zip(path)
    try:
        return torch.load(path, map_location="cpu", pickle_module=_pickle_module(path),
                          weights_only=False, mmap=mmap)
    except CheckpointError:
        raise
    except (pickle.UnpicklingError, RuntimeError, ValueError, TypeError, EOFError, KeyError) as err:
        raise CheckpointError(f"cannot read {path}: {type(err).__name__}: "
                              f"{' '.join(str(err).split())}; the file is damaged or not a "
                              "DeepSpeed checkpoint file") from None
