"""`save_16bit_model`: the model's weights, whole, in one safetensors file.

Under ZeRO-3 the parameters are gathered a few at a time with `GatheredParameters`
(consecutive parameters, about one transformer block per gather), and rank 0 streams
each group to the file before the next is gathered: the file holds real weights (never
the empty placeholders of released parameters), and no rank holds the whole model.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict

from torch import nn

from meshspeed import comm
from meshspeed.checkpoint.agree import agree
from meshspeed.checkpoint.errors import CheckpointError, describe_os_error
from meshspeed.checkpoint.snapshot import persistent_buffers, tied_aliases
from meshspeed.checkpoint.tensorfile import Spec, TensorFileWriter
from meshspeed.parallel.buckets import split_by_numel
from meshspeed.zero import GatheredParameters

GATHER_NUMEL = 2**26  # parameters gathered together (at least the largest one)


def _groups(named: list[tuple[str, nn.Parameter]], shapes: dict[str, tuple[int, ...]]
            ) -> list[list[tuple[str, nn.Parameter]]]:
    """Consecutive parameters of at most GATHER_NUMEL elements (full sizes)."""
    numel = {name: math.prod(shape) for name, shape in shapes.items()}
    return split_by_numel(named, max([GATHER_NUMEL, *numel.values()]),
                          numel=lambda item: numel[item[0]])


def _open(path: str, specs: list[Spec]) -> TensorFileWriter:
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    except OSError as err:
        raise CheckpointError(describe_os_error(err, os.path.dirname(path), "create")) from err
    return TensorFileWriter(path, specs, metadata={"format": "pt"})


def save_16bit_model(engine, save_dir, save_filename: str = "model.safetensors") -> str:
    """Write the module's state_dict (compute dtype; tied names included) to one file.

    Collective (gathers under ZeRO-3); rank 0 writes. Returns the file's path."""
    module = engine.module
    named = list(module.named_parameters())
    aliases_of = defaultdict(list)
    for alias, name in tied_aliases(module).items():
        aliases_of[name].append(alias)
    buffers = persistent_buffers(module)
    # full shapes from the strategy: a released ZeRO-3 parameter has numel 0 until gathered
    shapes = {s.name: tuple(s.shape) for s in engine.strategy.owned_slices()}
    specs = []
    for name, p in named:
        specs += [Spec(n, p.dtype, shapes[name]) for n in [name, *aliases_of[name]]]
    specs += [Spec(n, b.dtype, tuple(b.shape)) for n, b in buffers.items()]
    path = os.path.join(os.fspath(save_dir), save_filename)
    writer, error = None, None
    if comm.get_rank() == 0:
        try:
            writer = _open(path, specs)
        except Exception as err:  # noqa: BLE001 - reported on every rank below
            error = err
    for group in _groups(named, shapes):  # every rank joins every gather, even after a write error
        with GatheredParameters([p for _, p in group]):
            if writer is None or error is not None:
                continue
            try:
                for name, p in group:
                    for n in [name, *aliases_of[name]]:
                        writer.write(n, p.detach())
            except Exception as err:  # noqa: BLE001
                error = err
    if writer is not None and error is None:
        try:
            for n, b in buffers.items():
                writer.write(n, b)
            writer.close()
        except Exception as err:  # noqa: BLE001
            error = err
    if writer is not None and error is not None:
        writer.abort()
    agree(error)
    return path
