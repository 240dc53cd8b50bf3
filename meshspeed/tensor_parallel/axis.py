"""`apply_tp(model, mesh, config)`: tensor parallelism as `meshspeed.initialize` applies it
(Note [one contract for every axis] in meshspeed/parallel/protocol.py).

The model's layers are split over the mesh's tp axis when the config (or a `tp_model_init`
request recorded on the model) asks for it; a model the user already split is checked
against the mesh instead, and with an mpu and no `autotp_size` the model is the user's own
model-parallel code (Megatron layers) and is left as it is. What the engine keeps is the
step part: partial gradients of sequence-parallel norms summed over tp, and which
gradients the norm counts on every tp rank (grads.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from meshspeed import comm
from meshspeed.config import ConfigError, MeshspeedConfig
from meshspeed.tensor_parallel.apply import apply_tensor_parallel
from meshspeed.tensor_parallel.ds_config import plan_from_deepspeed
from meshspeed.tensor_parallel.grads import TensorParallelGrads
from meshspeed.tensor_parallel.request import request_of
from meshspeed.topology import Topology
from meshspeed.topology.shards import shards_by_param

__all__ = ["apply_tp", "tp_degree"]


def tp_degree(config: MeshspeedConfig, model: nn.Module) -> int:
    """tp from the config, merged with a `tp_model_init` request recorded on the model
    (the config wins; a different non-default value in each is an error)."""
    tp = config.tensor_parallel.size
    request = request_of(model)
    if request is None:
        return tp
    if tp > 1 and request["tp_size"] != tp:
        raise ConfigError([(f"tensor_parallel.autotp_size: {tp}, but tp_model_init asked for "
                           f"tp_size {request['tp_size']}; make them equal or drop one")])
    return max(tp, request["tp_size"])


def apply_tp(model: nn.Module, mesh: Topology, config: MeshspeedConfig) -> TensorParallelGrads:
    """Split `model` over `mesh`'s tp axis as `config` asks, in place; returns the engine's
    step part (inactive at tp 1). Collective over the tp group when it splits."""
    cfg, dtype = config.tensor_parallel, config.precision_dtype
    if shards_by_param(model):
        _check_presplit(model, mesh)
    else:
        request = request_of(model)
        if request is not None and request["dtype"] not in (dtype, torch.float32):
            raise ConfigError([(f"tp_model_init(dtype={request['dtype']}): the config trains in {dtype}; "
                               "enable the matching bf16/fp16 section (or pass that dtype)")])
        if request is not None and not cfg.enabled and request["tp_size"] > 1:
            cfg = cfg.model_copy(update={"autotp_size": request["tp_size"]})
        if cfg.enabled:
            plan = None if cfg.partition_config is None else plan_from_deepspeed(cfg.partition_config, model)
            apply_tensor_parallel(model, mesh, plan, sequence_parallel=cfg.sequence_parallel,
                                  overlap_comm=cfg.tp_overlap_comm, overlap_chunks=cfg.overlap_chunks)
            _same_replicas(model, mesh)
        elif cfg.sequence_parallel or cfg.tp_overlap_comm:
            raise ConfigError([("tensor_parallel.sequence_parallel / tp_overlap_comm need "
                               "tensor_parallel.autotp_size > 1")])
    return TensorParallelGrads(model, mesh.group("tp"), mesh.size("tp"))


def check_requested_group(model: nn.Module, mesh: Topology) -> None:
    """A `tp_model_init(tp_group=...)` group must be this rank's tp group of the mesh."""
    group = (request_of(model) or {}).get("tp_group")
    if group is not None and sorted(dist.get_process_group_ranks(group)) != mesh.ranks("tp"):
        raise ConfigError([(f"tp_model_init(tp_group=...): the group's ranks "
                           f"{sorted(dist.get_process_group_ranks(group))} are not this rank's "
                           f"tensor-parallel ranks {mesh.ranks('tp')} (tp fastest: ranks "
                           "r, r+1, ... form a group)")])


def _check_presplit(model: nn.Module, mesh: Topology) -> None:
    want = mesh.ranks("tp")
    for name, sub in model.named_modules():
        # a layer split by the user carries `tp_shards` and, when it communicates, its `group`
        group = getattr(sub, "group", None) if getattr(sub, "tp_shards", None) else None
        if group is not None and sorted(dist.get_process_group_ranks(group)) != want:
            raise ConfigError([(f"{name}: split over ranks {sorted(dist.get_process_group_ranks(group))}, "
                               f"but this run's tensor-parallel group is {want}; split the model "
                               "over engine.mesh (or the same layout) or let initialize split it")])


@torch.no_grad()
def _same_replicas(model: nn.Module, mesh: Topology) -> None:
    """Parameters tensor parallelism left whole start equal on every tp rank (tp rank 0's),
    whatever each rank's seed was: they must stay replicas."""
    split = shards_by_param(model)
    group = mesh.group("tp")
    for p in model.parameters():
        if id(p) not in split:
            comm.broadcast(p.data, src=0, group=group)
