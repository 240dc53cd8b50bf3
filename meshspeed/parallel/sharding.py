"""`apply_dp(model, mesh, config, ...)`: the sharding axis as `meshspeed.initialize` applies it
(Note [one contract for every axis] in meshspeed/parallel/protocol.py).

ZeRO stage 0 is data parallelism (parallel/data/ddp.py), stages 1-3 are `Zero`
(parallel/zero/strategy.py, what each stage shards: parallel/zero/stages.py); both shard
or replicate over the mesh's dp x cp group, with offload injected as a placement and
expert parameters described by an ExpertSpec. ZeRO++'s node groups (hpZ's secondary
partition, qgZ's two hops) are sub-axis groups of the mesh (Note [sub-axis groups] in
topology/mesh.py).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from meshspeed import comm
from meshspeed.config import ConfigError, MeshspeedConfig
from meshspeed.parallel.data.compress import GradCompression
from meshspeed.parallel.data.ddp import DataParallel
from meshspeed.parallel.experts import ExpertSpec
from meshspeed.parallel.protocol import Strategy
from meshspeed.parallel.zero import nodes, qgz, qwz
from meshspeed.parallel.zero.groups import UnitGroups
from meshspeed.parallel.zero.init_shards import gather_partitioned, is_partitioned
from meshspeed.parallel.zero.strategy import Zero
from meshspeed.topology import Topology

__all__ = ["apply_dp"]

log = logging.getLogger("meshspeed")

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def apply_dp(model: nn.Module, mesh: Topology, config: MeshspeedConfig, *, placement=None,
             experts: ExpertSpec | None = None, local_ranks: int = 1) -> Strategy:
    """The sharding strategy of `config.zero_optimization` over the mesh's dp x cp group.
    `placement`: offload (meshspeed/offload), None for device memory; `local_ranks`: ranks
    per machine, for qgZ's hops when hpZ gives no nodes."""
    z = config.zero_optimization
    if config.zero_stage == 0:
        for p in model.parameters():  # zero.Init slices: data parallelism needs them whole
            if is_partitioned(p):
                gather_partitioned(p)
        return DataParallel(model, mesh.group("dp_cp"), bucket_numel=z.reduce_bucket_size,
                            comm_dtype=_comm_dtype(config), overlap_comm=z.overlap_comm,
                            experts=experts, compression=_grad_compression(config))
    return Zero(
        model, _zero_groups(config, mesh, local_ranks), stage=config.zero_stage,
        bucket_numel=z.reduce_bucket_size, persistence_threshold=z.stage3_param_persistence_threshold,
        prefetch_numel=z.stage3_prefetch_bucket_size, max_live_numel=z.stage3_max_live_parameters,
        comm_dtype=_comm_dtype(config), placement=placement, experts=experts,
        weight_block=qwz.BLOCK if z.zero_quantized_weights else None,
        grad_block=qgz.GRAD_BLOCK if z.zero_quantized_gradients else None,
    )


def _comm_dtype(cfg: MeshspeedConfig) -> torch.dtype:
    # gradients are reduced in fp32 unless the config asks for the low-precision dtype
    name = cfg.communication_data_type
    return torch.float32 if name is None else _DTYPES[name]


def _zero_groups(cfg: MeshspeedConfig, mesh: Topology, local_ranks: int) -> UnitGroups:
    """ZeRO's groups: the dp (x cp) group it shards over and, for ZeRO++, the node groups
    of hpZ's secondary partition and of qgZ's two hops (parallel/zero/nodes.py)."""
    z, dp_group = cfg.zero_optimization, mesh.group("dp_cp")
    size, zero_groups = z.zero_hpz_partition_size, mesh.dims.groups("dp_cp")
    hpz_blocks = secondary = hops = None
    try:
        if size > 1:
            hpz_blocks = nodes.blocks(zero_groups, size)
            secondary = mesh.subgroup(f"hpZ node ({size})", nodes.inside(hpz_blocks))
            if size == mesh.size("dp_cp") and comm.get_rank() == 0:
                log.warning("zero_hpz_partition_size %d is the whole ZeRO group: the secondary copy adds "
                            "memory and moves no fewer bytes; use the ranks of one node", size)
        if z.zero_quantized_gradients:  # Note [qgZ's two hops]: hpZ's nodes, else the machines'
            hop_blocks = hpz_blocks or nodes.by_node(zero_groups, local_ranks)
            if 1 < len(hop_blocks[0][0]) < mesh.size("dp_cp"):
                per = len(hop_blocks[0][0])
                hops = qgz.NodeGroups(intra=mesh.subgroup(f"qgZ in node ({per})", nodes.inside(hop_blocks)),
                                      inter=mesh.subgroup(f"qgZ across nodes ({per})", nodes.across(hop_blocks)))
                _check_places(hops, dp_group)
    except ValueError as err:
        raise ConfigError([f"zero_optimization: {err}"]) from err
    return UnitGroups(shard=dp_group, secondary=secondary, nodes=hops)


def _check_places(hops, dp_group) -> None:
    """qgZ's shard j = g L + l must be node g's rank at place l (ascending group ranks)."""
    rank, per_node = comm.get_rank(dp_group), hops.per_node
    if (comm.get_rank(hops.intra), comm.get_rank(hops.inter)) != (rank % per_node, rank // per_node):
        raise ValueError(f"the ZeRO group's rank order does not follow the global ranks (rank {rank} of it is "
                         f"place {comm.get_rank(hops.intra)} of node {comm.get_rank(hops.inter)}); qgZ's two "
                         "hops need ascending groups")


def _grad_compression(cfg: MeshspeedConfig) -> GradCompression | None:
    gc = cfg.gradient_compression  # the composition table refuses it with ZeRO stages 1-3
    if gc is None:
        return None
    return GradCompression(method=gc.method, ratio=gc.ratio, chunk=gc.chunk,
                           error_feedback=gc.error_feedback, warmup_steps=gc.warmup_steps,
                           two_hop=gc.exchange == "two_hop")
