"""``from deepspeed.runtime.pipe.module import PipelineModule, LayerSpec, TiedLayerSpec``.

DeepSpeed's `PipelineModule` takes its layout as a `ProcessTopology` (`topology=`) and
answers `topology()`; meshspeed's (meshspeed/parallel/pipeline/module.py) takes a number
of stages and gets its stage from the mesh at initialize. This subclass is the adapter:
the topology's "pipe" axis becomes `num_stages`, its "model" axis the tensor-parallel
degree the engine checks, and its layout must put the pipe axis first, as the mesh does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from meshspeed.compat.deepspeed.runtime.pipe.topology import (
    PipeDataParallelTopology,
    ProcessTopology,
)
from meshspeed.parallel.activation_checkpoint import checkpoint
from meshspeed.parallel.pipeline import module as core
from meshspeed.parallel.pipeline.module import LayerSpec, TiedLayerSpec
from meshspeed.topology.degrees import pipeline_stage

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec", "split_sequential"]


class PipelineModule(core.PipelineModule):
    """DeepSpeed's `PipelineModule(layers, num_stages, topology, loss_fn, ...)`."""

    def __init__(self, layers: Sequence[Any], num_stages: int | None = None,
                 topology: ProcessTopology | None = None, loss_fn: Callable | None = None,
                 seed_layers: bool = False, seed_fn: Callable[[int], Any] | None = None,
                 base_seed: int = 1234, partition_method: str = "parameters",
                 activation_checkpoint_interval: int = 0,
                 activation_checkpoint_func: Callable | None = checkpoint,
                 checkpointable_layers: list[str] | None = None, dynamic_shape: bool = False,
                 virtual_stages: int = 1):
        if topology is not None:
            stages = topology.get_dim("pipe") or 1
            if num_stages is not None and num_stages != stages:
                raise ValueError(f"PipelineModule(num_stages={num_stages}) but the topology has {stages} "
                                 "pipe stages; give one of them")
            num_stages = stages
        super().__init__(layers, num_stages=num_stages, loss_fn=loss_fn, seed_layers=seed_layers,
                         seed_fn=seed_fn, base_seed=base_seed, partition_method=partition_method,
                         activation_checkpoint_interval=activation_checkpoint_interval,
                         activation_checkpoint_func=activation_checkpoint_func,
                         checkpointable_layers=checkpointable_layers, dynamic_shape=dynamic_shape,
                         virtual_stages=virtual_stages)
        world = self.world_size
        self._topo = topology or PipeDataParallelTopology(num_pp=self.num_stages, num_dp=world // self.num_stages)
        if self._topo.world_size() != world:
            raise ValueError(f"PipelineModule topology {self._topo} has {self._topo.world_size()} ranks, "
                             f"the job has {world}")
        _check_pipe_slowest(self._topo, world, self.num_stages)
        self.model_parallel_size = self._topo.get_dim("model") or None

    def topology(self) -> ProcessTopology:
        return self._topo

    @property
    def is_checkpointable_results(self) -> list[bool]:
        """For each block of `activation_checkpoint_interval` layers of this stage, whether
        forward recomputes it (DeepSpeed's cached list; here read from the current interval
        and layers each time, so it cannot go stale)."""
        interval = self.activation_checkpoint_interval
        if interval <= 0:
            return []
        return [self._checkpointable(c.funcs[i:i + interval], c.names[i:i + interval])
                for c in self.chunks() for i in range(0, len(c.funcs), interval)]

    def _precompute_checkpointable_values(self) -> list[bool]:
        """DeepSpeed's cache filler; nothing is cached here (is_checkpointable_results)."""
        return self.is_checkpointable_results


def _check_pipe_slowest(topo: ProcessTopology, world: int, stages: int) -> None:
    """A DeepSpeed topology must put the pipe axis first (slowest), as meshspeed's mesh does."""
    if "pipe" not in topo.axes:
        return
    for rank in range(world):
        if topo.get_coord(rank).pipe != pipeline_stage(rank, world, stages):
            raise ValueError(f"PipelineModule topology {topo}: rank {rank} is on stage "
                             f"{topo.get_coord(rank).pipe} there, but meshspeed lays stages out as "
                             "consecutive blocks of ranks (the 'pipe' axis first, as in "
                             "PipeModelDataParallelTopology)")


def split_sequential(model, num_stages: int, **kwargs: Any) -> PipelineModule:
    """`split_sequential` building DeepSpeed's PipelineModule (meshspeed's own is in
    meshspeed/parallel/pipeline/module.py)."""
    return core.split_sequential(model, num_stages, module_class=PipelineModule, **kwargs)
