"""Several model-parallel ranks of a DeepSpeed tag seen as one checkpoint of whole tensors.

    ckpt = Stages(parts, path)       # pipeline stages: each part holds other parameters
    ckpt = Pieces(parts, path, dims) # tensor-parallel ranks: each part holds a piece of each

Both offer what to_meshspeed.py and consolidate.py read from a one-rank
`DeepSpeedCheckpoint` (read.py): names and shapes, `params()` one whole parameter at a
time, buffers, optimizer groups, counters, scheduler, loss scaler and client state (the
last four from the first part: DeepSpeed writes the same engine state into every
model-parallel rank's model-states file).
"""

from __future__ import annotations

from collections.abc import Iterator
import torch

from meshspeed.checkpoint.deepspeed_format.read import DeepSpeedCheckpoint, ParamState
from meshspeed.checkpoint.errors import CheckpointError


class _Combined:
    """What every combination shares: the engine state of the first part."""

    def __init__(self, parts: list[DeepSpeedCheckpoint], path: str):
        if not parts:
            raise CheckpointError(f"{path} holds no model-parallel rank to read")
        self.parts = parts
        self._path = path
        first = parts[0]
        self.header = first.header
        self.stage = first.stage
        self.dp_size = first.dp_size
        self.loss_scaler = first.loss_scaler
        self.group_options = first.group_options
        for p in parts[1:]:
            if p.stage != first.stage:
                raise CheckpointError(f"{path}: model-parallel ranks were saved at different ZeRO stages "
                                      f"({first.stage} and {p.stage}); the files do not belong together")

    path = property(lambda self: self._path)
    lr_scheduler = property(lambda self: self.parts[0].lr_scheduler)
    counters = property(lambda self: self.parts[0].counters)
    client_state = property(lambda self: self.parts[0].client_state)
    config = property(lambda self: self.parts[0].config)
    precision = property(lambda self: self.parts[0].precision)


class Stages(_Combined):
    """Pipeline stages: the parts hold disjoint parameters, read one part after another."""

    def __init__(self, parts: list[DeepSpeedCheckpoint], path: str):
        super().__init__(parts, path)
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.buffers: dict[str, torch.Tensor] = {}
        self.aliases: dict[str, str] = {}
        self._owner: dict[str, DeepSpeedCheckpoint] = {}
        groups = max(len(p.group_names) for p in parts)
        self.group_names: list[list[str]] = [[] for _ in range(groups)]
        for p in parts:
            for name in p.all_param_names():
                if name in self._owner:
                    raise CheckpointError(f"{path}: parameter {name!r} is held by two pipeline stages; "
                                          "tied layers across stages are not read yet")
                self._owner[name] = p
            self.shapes.update(p.shapes)
            self.buffers.update(p.buffers)
            self.aliases.update(p.aliases)
            for g, names in enumerate(p.group_names):
                self.group_names[g] += names
        if len(self.group_options) < groups:
            self.group_options = max((p.group_options for p in parts), key=len)

    @property
    def trainable(self) -> set[str]:
        return {n for g in self.group_names for n in g}

    def all_param_names(self) -> list[str]:
        return [n for p in self.parts for n in p.all_param_names()]

    def moment_keys(self, name: str) -> list[str]:
        return self._owner[name].moment_keys(name)

    def params(self) -> Iterator[ParamState]:
        for p in self.parts:
            yield from p.params()


class Pieces(_Combined):
    """Tensor-parallel ranks: every part holds the same parameter names, each a piece of the
    whole along `dims[name]` (None: replicated, the first part's copy is taken)."""

    def __init__(self, parts: list[DeepSpeedCheckpoint], path: str, dims: dict[str, int | None],
                 trim: dict[str, int] | None = None):
        super().__init__(parts, path)
        first = parts[0]
        names = first.all_param_names()
        for t, p in enumerate(parts[1:], 1):
            if p.all_param_names() != names:
                raise CheckpointError(f"{path}: tensor-parallel rank {t} holds other parameters than rank 0 "
                                      "(mp_rank_00 vs mp_rank_%02d); the files do not belong together" % t)
        self.dims = dims
        self.group_names = first.group_names
        self.buffers = first.buffers
        self.aliases = first.aliases
        self.trim = trim or {}  # name -> whole size along its dim (a padded vocabulary's rows)
        self.shapes = {n: _whole_shape([p.shapes[n] for p in parts], dims.get(n), self.trim.get(n))
                       for n in names}

    @property
    def trainable(self) -> set[str]:
        return self.parts[0].trainable

    def all_param_names(self) -> list[str]:
        return self.parts[0].all_param_names()

    def moment_keys(self, name: str) -> list[str]:
        return self.parts[0].moment_keys(name)

    def params(self) -> Iterator[ParamState]:
        for states in zip(*(p.params() for p in self.parts)):
            name = states[0].name
            dim = self.dims.get(name)
            if dim is None:
                yield states[0]
                continue
            size = self.trim.get(name)

            def join(ts: list[torch.Tensor]) -> torch.Tensor:
                whole = torch.cat(ts, dim)
                return whole if size is None else whole.narrow(dim, 0, size).clone()

            moments = {k: join([s.moments[k] for s in states]) for k in states[0].moments}
            yield ParamState(name, join([s.master for s in states]), moments, states[0].step)


def _whole_shape(shapes: list[tuple[int, ...]], dim: int | None, size: int | None) -> tuple[int, ...]:
    if dim is None:
        return shapes[0]
    out = list(shapes[0])
    out[dim] = sum(s[dim] for s in shapes) if size is None else size
    return tuple(out)
