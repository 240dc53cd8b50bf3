"""`apply_ep(model, mesh, config)`: expert parallelism as `meshspeed.initialize` applies it
(Note [one contract for every axis] in meshspeed/parallel/protocol.py).

The mesh's ep axis is the `ep_size` of the model's MoE layers (`ep_degree`); every layer
with ep_size > 1 is handed the mesh's ep group, and the sharding strategy gets an
`ExpertSpec` saying which parameters are experts (Note [expert parameters in the
strategies] in meshspeed/parallel/experts.py). MoE layers with ep_size 1 train as any
layer: their experts are local, their gradients averaged over data parallelism.

Note [MoE layers on tensor-parallel ranks]
Tensor parallelism leaves MoE layers whole (the GPT's plan names no expert or router;
tp's `_same_replicas` starts them equal on the tp ranks): each tp rank holds whole local
experts and, sequence parallelism being refused with MoE (the composition table),
receives the same replicated tokens. If every tp rank also routes them alike, it computes
the same outputs, and backward the same expert and router gradients, which are therefore
NOT reduced over tp (they are replicas, like a norm's weight; the gradient norm counts them
once through the tp_split mask) and are reduced over dp / edp within this rank's tp
coordinate, the ep and edp groups being per tp coordinate (topology/degrees.py). Routing
alike needs the same random draws (RTS, second-expert sampling, jitter: Note [random
numbers in gating]), which come from the default generators. The engine leaves those
alone (the tp RNG tracker's per-rank stream is used only inside its fork()), but a
script may seed each rank differently; so initialize gives every tp rank tp rank 0's
host and device generator states, once. Draws then stay equal: tp ranks run the same
code on the same data.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from meshspeed import comm
from meshspeed.config import ConfigError, MeshspeedConfig
from meshspeed.moe.utils import expert_layers, global_expert_names
from meshspeed.parallel.experts import ExpertSpec
from meshspeed.topology import Topology
from meshspeed.topology.shards import shards_by_param

__all__ = ["apply_ep", "ep_degree"]

log = logging.getLogger("meshspeed")


def ep_degree(model: nn.Module) -> int:
    """ep: the `ep_size` of the model's MoE layers (1 without any). Every layer with
    ep_size > 1 must have the same one: the mesh has one ep axis."""
    sizes = {name: layer.ep_size for name, layer in expert_layers(model)}
    distinct = sorted(set(sizes.values()))
    if len(distinct) > 1:
        first = {size: name for name, size in reversed(list(sizes.items()))}
        which = ", ".join(f"{first[n]!r} has ep_size {n}" for n in distinct)
        raise ConfigError([(f"MoE layers with different ep_size ({which}): the mesh has one "
                           "expert-parallel axis; build every MoE layer with the same ep_size")])
    return distinct[0] if distinct else 1


def apply_ep(model: nn.Module, mesh: Topology, config: MeshspeedConfig,
             device: torch.device) -> ExpertSpec | None:
    """Wire the MoE layers to the mesh's ep group; the strategy's ExpertSpec, None without
    expert parallelism. Collective over tp (the generator states) when MoE meets tp."""
    layers = expert_layers(model)
    _check_experts_whole(layers, model)
    if layers and mesh.size("tp") > 1:
        _route_alike_over_tp(layers, mesh, device)
    if mesh.size("ep") == 1:
        return None
    group = mesh.group("ep")
    for _, layer in layers:
        if layer.ep_size > 1:
            layer.set_expert_group(group)
    names = global_expert_names(model, mesh.coord("ep"))
    return ExpertSpec(mesh.group("edp"), mesh.size("dp"), names)


def _check_experts_whole(layers, model: nn.Module) -> None:
    """MoE layers stay whole on every tp rank (Note [MoE layers on tensor-parallel ranks]):
    a plan that split one of their parameters is refused."""
    split = shards_by_param(model)
    for name, layer in layers if split else ():
        hit = next((p for p, param in layer.named_parameters() if id(param) in split), None)
        if hit is not None:
            raise ConfigError([(f"{name}.{hit}: the tensor-parallel plan splits a parameter of an MoE "
                               "layer; MoE layers (experts and router) stay whole on every tensor-"
                               "parallel rank in this version, so leave them out of the plan")])


def _route_alike_over_tp(layers, mesh: Topology, device: torch.device) -> None:
    """Note [MoE layers on tensor-parallel ranks]: tp rank 0's generator states everywhere."""
    group = mesh.group("tp")
    torch.set_rng_state(comm.broadcast_object(torch.get_rng_state(), src=0, group=group))
    if device.type == "cuda":
        state = comm.broadcast_object(torch.cuda.get_rng_state(device).cpu(), src=0, group=group)
        torch.cuda.set_rng_state(state, device)
    if comm.get_rank() == 0 and any(layer.enable_expert_tensor_parallelism for _, layer in layers):
        log.warning("MoE enable_expert_tensor_parallelism=True has no effect: experts are not split "
                    "over tensor parallelism in this version, each tp rank holds whole experts")
