"""`save_16bit_model`: the model's weights, whole, in one safetensors file.

Under ZeRO-3 the parameters are gathered a few at a time with `GatheredParameters`
(consecutive parameters, about one transformer block per gather), and rank 0 streams
each group to the file before the next is gathered: the file holds real weights (never
the empty placeholders of released parameters), and no rank holds the whole model. Under
tensor parallelism each split parameter is all-gathered over the tp group as well, and
rank 0 writes the logical (whole) tensor.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict

import torch
from torch import nn

from meshspeed import comm
from meshspeed.checkpoint.agree import agree, everywhere
from meshspeed.checkpoint.errors import CheckpointError, describe_os_error
from meshspeed.checkpoint.snapshot import (
    ordered_slices,
    persistent_buffers,
    tied_aliases,
    tp_layout,
)
from meshspeed.checkpoint.tensorfile import Spec, TensorFileWriter
from meshspeed.checkpoint.tp_ranges import logical_shape
from meshspeed.parallel.buckets import split_by_numel
from meshspeed.parallel.gather import gathered
from meshspeed.topology.shards import TPShard

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


class TPGather:
    """Whole (logical) tensors from the tensor-parallel pieces of the split parameters.

    Collective over the tp group, one all-gather per split parameter; only the rank that
    writes assembles the logical tensor (the others drop what they received)."""

    def __init__(self, slices, group, assemble: bool):
        self.group, self.assemble = group, assemble
        mine = {s.name: s.tp.to_json() for s in slices if s.tp is not None}
        # each peer's shard (local sizes may differ between tp ranks)
        self.peers = ([] if group is None else
                      [{n: TPShard.from_json(d) for n, d in p.items()}
                       for p in comm.all_gather_object(mine, group=group)])
        self.split = set(mine)

    def whole(self, name: str, local: torch.Tensor) -> torch.Tensor | None:
        if name not in self.split:
            return local
        shards = [peer[name] for peer in self.peers]
        numel = max(math.prod(s.local_shape) for s in shards)
        flat = local.new_zeros(numel)
        flat[: local.numel()].copy_(local.reshape(-1))
        received = [torch.empty_like(flat) for _ in shards]
        comm.all_gather(received, flat, group=self.group)
        if not self.assemble:
            return None
        full = local.new_zeros(shards[0].logical_shape)
        for shard, got in zip(shards, received):
            shard.logical_into(got[: math.prod(shard.local_shape)].view(shard.local_shape), full)
        return full


def _refuse_experts(engine, what: str) -> None:
    topology = engine.topology
    if topology.size("ep") > 1:  # every rank refuses alike
        raise CheckpointError(f"{what} with expert parallelism (ep {topology.size('ep')}): "
                              "each ep rank holds other experts and this version writes rank 0's "
                              "module only; use save_checkpoint (experts saved by global id) and "
                              "consolidate it, or train with ep_size 1")


def _whole_tensors(engine):
    """The specs (name, dtype, shape) of every entry, and an iterator over (name, logical
    tensor, frozen: a parameter that does not require grad): every parameter under each of its names (tied aliases too), then the
    persistent buffers. Collective: every rank must run the iterator to its end (the
    gathers and the tp all-gathers); the tensors are real on rank 0 only (None elsewhere
    for split parameters) and valid until the next item."""
    module = engine.module
    named = list(module.named_parameters())
    aliases_of = defaultdict(list)
    for alias, name in tied_aliases(module).items():
        aliases_of[name].append(alias)
    buffers = persistent_buffers(module)
    # logical shapes from the strategy's slices (a released ZeRO-3 parameter has numel 0
    # until gathered; a tensor-parallel one is a piece of its logical shape)
    slices = everywhere(ordered_slices, engine)
    shapes = {s.name: logical_shape(s) for s in slices}
    tp = TPGather(slices, tp_layout(engine)[2], assemble=comm.get_rank() == 0)
    specs = []
    for name, p in named:
        specs += [Spec(n, p.dtype, shapes[name]) for n in [name, *aliases_of[name]]]
    specs += [Spec(n, b.dtype, tuple(b.shape)) for n, b in buffers.items()]

    def entries():
        for group in _groups(named, shapes):
            with gathered([p for _, p in group]):
                for name, p in group:
                    whole = tp.whole(name, p.detach())
                    for n in [name, *aliases_of[name]]:
                        yield n, whole, not p.requires_grad
        for n, b in buffers.items():
            yield n, b, False

    return specs, entries()


def save_16bit_model(engine, save_dir, save_filename: str = "model.safetensors") -> str:
    """Write the module's state_dict (compute dtype; tied names included) to one file.

    Collective (gathers under ZeRO-3, and the tensor-parallel pieces over the tp group: the
    file holds logical, whole tensors); rank 0 writes. Returns the file's path."""
    _refuse_experts(engine, "save_16bit_model")
    specs, entries = _whole_tensors(engine)
    path = os.path.join(os.fspath(save_dir), save_filename)
    writer, error = None, None
    if comm.get_rank() == 0:
        try:
            writer = _open(path, specs)
        except Exception as err:  # noqa: BLE001 - reported on every rank below
            error = err
    for name, tensor, _ in entries:  # every rank joins every gather, even after a write error
        if writer is None or error is not None:
            continue
        try:
            writer.write(name, tensor)
        except Exception as err:  # noqa: BLE001
            error = err
    if writer is not None and error is None:
        try:
            writer.close()
        except Exception as err:  # noqa: BLE001
            error = err
    if writer is not None and error is not None:
        writer.abort()
    agree(error)
    return path


def consolidated_state_dict(engine, exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor] | None:
    """The module's whole state_dict (compute dtype, logical tensors, tied names included)
    on rank 0, as CPU copies; None on the other ranks. Collective, like save_16bit_model,
    and, like it, never holding more than one gather group beyond the result."""
    _refuse_experts(engine, "the consolidated state dict")
    _, entries = _whole_tensors(engine)
    out: dict[str, torch.Tensor] = {}
    rank0 = comm.get_rank() == 0
    last, copy = None, None
    for name, tensor, frozen in entries:  # every rank joins every gather
        if rank0 and not (exclude_frozen_parameters and frozen):
            # A tied parameter's names come one after another with the same tensor: they
            # share one copy, as in the module, so save_pretrained sees them as tied.
            if tensor is not last:
                last, copy = tensor, tensor.detach().to("cpu", copy=True)
            out[name] = copy
    return out if rank0 else None
