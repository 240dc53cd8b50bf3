"""What one rank puts in a checkpoint, captured from a live engine.

A snapshot is the list of tensors for the rank's file plus the JSON that describes them;
with `copy=True` (asynchronous saves) every tensor is copied to host memory, so training
may change the originals while a background thread writes the copies. State in swap files
is not read here but when it is written (Note [streaming swapped state]).

Note [streaming swapped state]
With `offload_optimizer.device: "nvme"` the fp32 masters (`OwnedSlice.swap`) and the
optimizer's moments (`SwappedState`, meshspeed/offload/state.py) live in swap files: 12
bytes a parameter, ~24 GB for 2B parameters on one rank, which host memory is not meant
to hold at once. The snapshot holds each of them as a `Deferred` (dtype, shape, and how
to read it; meshspeed/parallel/slices.py), and the writer reads each right before
writing it into the rank file and lets it go (writer.py `stream_tensors`): one tensor of
one parameter's range in memory at a time. State in memory is saved from views of the
live tensors, no copy, as before.

An asynchronous save cannot do this in its background thread: the next step rewrites
the swap files (masters and moments, sub-group by sub-group) while the thread would be
reading them, and the checkpoint would mix two steps. Copying them first is what an
asynchronous save of state in memory does, but here that copy is the whole swapped
state: the memory NVMe offload exists not to use. So a snapshot holding Deferred
entries takes no copies (`capture`), and when any rank's does, `save_checkpoint` writes
the checkpoint before it returns, streaming, with a warning the first time
(save.py); `async_save` still applies where the state is in memory. Overlapping such a
save with training would need the step to wait, sub-group by sub-group, until the saver
has read what it is about to rewrite; not done.

Note [a checkpoint of pipeline stages]
Every stage saves only its own layers, under their global names ("5.attn.wq.weight"), so
rank 0 does not know every parameter: each rank's marker lists the parameters it saved
(name, logical shape, dtype) and meta.json takes the union. A tied layer is saved once,
from its first stage. Persistent buffers are saved by the first rank of each stage, and
meta.json records the file of each. Loading reads each parameter by name, whatever stage
now holds it: a pipelined checkpoint loads at any pp, tp and dp (and without a pipeline).

Loading is per range already (load.py): each master range is read into one buffer and
written to its swap file, each parameter's moments into fresh tensors that
`optimizer.state[p] = entry` writes to their files; one parameter at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from meshspeed import comm
from meshspeed.checkpoint import tp_ranges
from meshspeed.checkpoint.errors import CheckpointError
from meshspeed.checkpoint.jsonable import capture_rng, encode_client_state
from meshspeed.checkpoint.metadata import dtype_name, global_meta, param_spec
from meshspeed.checkpoint.paths import rank_file
from meshspeed.parallel.protocol import RankState, declares
from meshspeed.parallel.slices import Deferred, deferred_master, deferred_state
from meshspeed.topology.shards import shards_by_param


@dataclass
class RankSnapshot:
    rank: int
    # the rank file's content; swapped state as Deferred (Note [streaming swapped state])
    tensors: dict[str, torch.Tensor | Deferred]
    info: dict[str, Any]  # this rank's marker: ranges, optimizer scalars, RNG
    meta: dict[str, Any] | None = None  # rank 0: the rest of meta.json
    client_tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # rank 0

    @property
    def streams(self) -> bool:
        """Whether some of the content is read only when written (swapped state)."""
        return any(isinstance(t, Deferred) for t in self.tensors.values())


def tied_aliases(module: nn.Module) -> dict[str, str]:
    """state_dict name of a repeated parameter -> the name named_parameters() reports."""
    first: dict[int, str] = {}
    aliases = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


def persistent_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for mod_name, mod in module.named_modules():
        for name, buf in mod._buffers.items():
            if buf is not None and name not in mod._non_persistent_buffers_set:
                out[f"{mod_name}.{name}" if mod_name else name] = buf
    return out


def tp_layout(engine) -> tuple[int, int, object]:
    """(tp coordinate, tp size, tp group) of this rank; (0, 1, None) without tensor parallelism."""
    topo = engine.topology
    if topo.size("tp") == 1:
        return 0, 1, None
    return topo.coord("tp"), topo.size("tp"), topo.group("tp")


def _with_shards(engine, slices: list) -> list:
    """The slices with `tp` filled from the layers' `tp_shards` (strategies leave it None).

    A slice is matched to its parameter by name, or else through the strategy's
    parameter -> master map (its `key` is the optimizer's tensor)."""
    shards = shards_by_param(engine.module)
    if not shards:
        return slices
    tp_rank, tp_size, _ = tp_layout(engine)
    by_name = dict(engine.module.named_parameters())
    master_of = engine.strategy.master_of
    by_master = {id(master_of[id(p)]): p for p in by_name.values() if id(p) in master_of}
    out = []
    for s in slices:
        param = by_name[s.name] if s.name in by_name else by_master.get(id(s.key))
        shard = shards.get(id(param)) if param is not None else None
        if shard is not None:
            if (shard.tp_rank, shard.tp_size) != (tp_rank, tp_size):
                raise CheckpointError(f"parameter {s.name!r} is tp rank {shard.tp_rank}'s piece of "
                                      f"{shard.tp_size}, but this rank is tp rank {tp_rank} of "
                                      f"{tp_size} (engine.topology)")
            if tuple(s.shape) != shard.local_shape:
                raise CheckpointError(f"parameter {s.name!r} has shape {tuple(s.shape)} but its "
                                      f"tensor-parallel shard says {shard.local_shape} (of logical "
                                      f"{shard.logical_shape})")
            s = replace(s, tp=shard)
        out.append(s)
    return out


def ordered_slices(engine) -> list:
    """The strategy's owned slices in `module.named_parameters()` order, each with its
    tensor-parallel shard (`OwnedSlice.tp`) when tensor parallelism split the parameter."""
    order = {name: i for i, (name, _) in enumerate(engine.module.named_parameters())}
    slices = sorted(engine.strategy.owned_slices(), key=lambda s: order.get(s.name, len(order)))
    return _with_shards(engine, slices)


def _unpadded(flat: torch.Tensor, s) -> torch.Tensor:
    """The elements of the slice's range that are not tensor-parallel padding, in order
    (a view when there is no padding in the range; Note [tensor-parallel ranges])."""
    runs = tp_ranges.runs(s.tp, s.start, s.end)
    if tp_ranges.held(runs) == s.end - s.start:
        return flat
    return torch.cat([flat[local - s.start : local - s.start + n] for local, _, n in runs]
                     or [flat[:0]])


def _range_values(value: torch.Tensor | Deferred, s) -> torch.Tensor | Deferred:
    """What is saved of a range tensor: its unpadded elements, flat; a Deferred stays one,
    reading (and unpadding) only when the writer asks (Note [streaming swapped state])."""
    if isinstance(value, Deferred):
        n = tp_ranges.held(tp_ranges.runs(s.tp, s.start, s.end))
        return Deferred(value.dtype, (n,), lambda: _unpadded(value.read().reshape(-1), s))
    return _unpadded(value.reshape(-1), s)


def _is_range_state(key: str, value: Any, param: torch.Tensor) -> bool:
    """Optimizer state shaped like its parameter (exp_avg, momentum_buffer, ...)."""
    return (isinstance(value, (torch.Tensor, Deferred)) and tuple(value.shape) == tuple(param.shape)
            and (param.dim() > 0 or key != "step"))


def _scalar(key: str, value: Any, name: str) -> dict[str, Any]:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        # fused/capturable optimizers keep "step" on the parameter's device; others on the CPU
        return {"value": value.item(), "dtype": dtype_name(value.dtype),
                "shape": list(value.shape), "on_device": value.device.type != "cpu"}
    if value is None or isinstance(value, (bool, int, float)):
        return {"value": value}
    raise CheckpointError(f"optimizer state {key!r} of parameter {name!r} is a "
                          f"{type(value).__name__} of shape {getattr(value, 'shape', '?')}: "
                          "neither parameter-shaped nor a scalar, so it cannot be sharded")


def _take(t: torch.Tensor | Deferred, copy: bool) -> torch.Tensor | Deferred:
    if isinstance(t, Deferred):
        return t
    t = t.detach()
    if copy or t.device.type != "cpu":
        return t.to("cpu", copy=True)
    return t


def _first_of_stage(engine) -> bool:
    """The rank at data, context and tensor coordinate 0 of a later pipeline stage: it
    saves that stage's persistent buffers (rank 0 saves the first stage's)."""
    topo = engine.topology
    if topo.source != "config" or topo.size("pp") == 1:
        return False
    return all(topo.coord(a) == 0 for a in ("dp", "cp", "tp"))


def capture(engine, tag: str, client_state: Any, *, copy: bool, exclude_frozen: bool = False) -> RankSnapshot:
    """This rank's part of the checkpoint (rank 0 also builds the global metadata).

    `copy`: copy every tensor to host memory, unless some of the state is in swap files
    (then nothing is copied and the save must not be asynchronous: Note [streaming
    swapped state])."""
    rank = comm.get_rank()
    slices = ordered_slices(engine)
    tp_rank, _, _ = tp_layout(engine)
    tensors: dict[str, torch.Tensor | Deferred] = {}
    ranges: dict[str, Any] = {}
    state = engine.optimizer.state
    skip = engine.checkpoint_skips()
    frozen: set[int] = set()
    if exclude_frozen:  # masters of parameters that do not require grad: not in the checkpoint
        frozen = {id(engine.strategy.master_of[id(p)]) for p in engine.module.parameters()
                  if not p.requires_grad and id(p) in engine.strategy.master_of}
        skip |= frozen
    params: dict[str, Any] = {}  # Note [a checkpoint of pipeline stages]
    for s in slices:
        # replicas over dp: the strategy's writer; replicas over tp: tp rank 0; a tied
        # layer's copy on a later pipeline stage: its first stage's copy is saved
        if not s.writer or s.end == s.start or (s.tp is None and tp_rank != 0) or id(s.key) in skip:
            continue
        params[s.name] = param_spec(s)
        tensors[f"master/{s.name}"] = _range_values(deferred_master(s), s)
        saved, scalars = [], {}
        for key, value in (deferred_state(state, s.key).items() if s.key in state else ()):
            if _is_range_state(key, value, s.key):
                tensors[f"optim/{key}/{s.name}"] = _range_values(value, s)
                saved.append(key)
            else:
                scalars[key] = _scalar(key, value, s.name)
        ranges[s.name] = {"start": s.start, "end": s.end, "optimizer": saved, "scalars": scalars}
        if s.tp is not None:
            ranges[s.name]["tp"] = s.tp.to_json()
    rng, rng_tensors = capture_rng()
    tensors.update(rng_tensors)
    # Note [rank-local state]: what only this rank holds (e.g. error-feedback residuals)
    local = engine.strategy.rank_state() if declares(engine.strategy, RankState) else {}
    tensors.update({f"rank_state/{k}": v for k, v in local.items()})
    buffers: dict[str, torch.Tensor] = {}
    if rank == 0 or _first_of_stage(engine):
        buffers = persistent_buffers(engine.module)
        tensors.update({f"buffer/{name}": b for name, b in buffers.items()})
    info = {"rank": rank, "file": rank_file(rank), "ranges": ranges, "rng": rng, "params": params,
            "rank_state": sorted(local)}
    if rank != 0 and buffers:
        info["buffers"] = {k: {"shape": list(b.shape), "dtype": dtype_name(b.dtype)}
                           for k, b in buffers.items()}
    snap = RankSnapshot(rank, tensors, info)
    copy = copy and not snap.streams
    for name, t in tensors.items():
        tensors[name] = _take(t, copy)
    if rank == 0:
        client_json, client_tensors = encode_client_state(client_state)
        # frozen parameters left out are left out of the metadata too, aliases of them included
        left_out = {s.name for s in slices if id(s.key) in frozen}
        listed = [s for s in slices if s.name not in left_out]
        aliases = {a: n for a, n in tied_aliases(engine.module).items() if n not in left_out}
        snap.meta = global_meta(engine, tag, listed, aliases, buffers,
                                client_json, list(client_tensors), tp_size=tp_layout(engine)[1])
        snap.client_tensors = client_tensors
    return snap
