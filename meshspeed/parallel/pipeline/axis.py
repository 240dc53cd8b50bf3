"""`apply_pp(model, mesh, config)`: pipeline parallelism as `meshspeed.initialize` applies it
(Note [one contract for every axis] in meshspeed/parallel/protocol.py).

A `PipelineModule` is bound to the mesh's pp coordinate and the config's virtual stages
(Note [the mesh binds the stage] in module.py), after the checks a pipelined run needs.
The engine's share is a `PipelineStep`: the pp group joins the gradient norm, and tied
layers on several stages are summed over them before each step (tied.py). Its `tie()`
runs once the stage's layers are final (after tensor parallelism split them), before
the sharding strategy takes the module: it makes the tied groups and starts every copy
equal.
"""

from __future__ import annotations

from dataclasses import replace

from meshspeed.config import ConfigError, MeshspeedConfig
from meshspeed.config.pipeline import PipelineConfig
from meshspeed.parallel.activation_checkpoint import non_reentrant_checkpoint
from meshspeed.parallel.pipeline.module import PipelineModule
from meshspeed.parallel.pipeline.partition import PartitionError
from meshspeed.parallel.pipeline.schedule import ScheduleError, build
from meshspeed.parallel.pipeline.tied import TiedGrads
from meshspeed.parallel.protocol import StepPart
from meshspeed.parallel.step import NormScope
from meshspeed.topology import Topology

__all__ = ["PipelineStep", "apply_pp", "virtual_stages"]


class PipelineStep(StepPart):
    def __init__(self, module: PipelineModule, mesh: Topology):
        self.module, self.mesh = module, mesh
        self.tied: TiedGrads | None = None

    def tie(self) -> None:
        """Tied layers' groups and equal copies (collective over the world)."""
        self.tied = TiedGrads(self.module, self.mesh)
        self.tied.broadcast_from_first()  # Note [summing tied gradients over stages]

    def before_step(self, strategy) -> None:
        if self.tied is not None and self.tied.active:  # Note [summing tied gradients over stages]
            self.tied.sum_grads(strategy, self.mesh.coord("dp"))

    def widen(self, scope: NormScope, strategy) -> NormScope:
        """Each stage holds its own layers' gradients: the norm sums over pp too, and
        counts a tied tensor once (copies off its first stage are skipped)."""
        skip = self.tied.duplicates(strategy.master_of) if self.tied is not None else set()
        return replace(scope, groups=(*scope.groups, self.mesh.group("pp")), skip=scope.skip | skip)


def virtual_stages(model: PipelineModule, pipe: PipelineConfig) -> int:
    """Model chunks per stage: the config's `pipeline.virtual_stages` when it gives one,
    else the module's; only the interleaved schedule runs more than one."""
    given = "virtual_stages" in pipe.model_fields_set
    built = model.virtual_stages
    if given and built > 1 and pipe.virtual_stages != built:
        raise ConfigError([(f"pipeline.virtual_stages: {pipe.virtual_stages}, but the PipelineModule was "
                           f"built with virtual_stages={built}; make them equal or drop one")])
    v = pipe.virtual_stages if given else built
    if pipe.schedule == "interleaved" and v < 2:
        raise ConfigError([("pipeline.schedule \"interleaved\" needs model chunks on each stage: set "
                           "\"pipeline\": {\"virtual_stages\": 2} (or more), or build "
                           "PipelineModule(..., virtual_stages=2)")])
    if pipe.schedule != "interleaved" and v > 1:
        where = "pipeline.virtual_stages" if given else "PipelineModule(virtual_stages=...)"
        raise ConfigError([(f"{where} = {v} runs only under pipeline.schedule \"interleaved\", the "
                           f"config says {pipe.schedule!r}")])
    return v


def apply_pp(model: PipelineModule, mesh: Topology, config: MeshspeedConfig) -> PipelineStep:
    """Check the pipelined run and bind the module to this rank's stage."""
    cfg = config.pipeline
    mp = model.model_parallel_size  # DeepSpeed's topology's "model" axis, None without one
    if mp and mp != config.tensor_parallel.size:
        raise ConfigError([(f"PipelineModule topology has a model axis of {mp}, but "
                           f"tensor_parallel.autotp_size is {config.tensor_parallel.size}: meshspeed "
                           f"splits a stage's layers itself; set \"tensor_parallel\": {{\"autotp_size\": "
                           f"{mp}}} or use PipeDataParallelTopology")])
    v = virtual_stages(model, cfg)
    m = config.gradient_accumulation_steps
    try:
        build(cfg.schedule, m, model.num_stages, v)
    except ScheduleError as err:
        raise ConfigError([(f"pipeline.schedule {cfg.schedule!r}: {err} (the micro-batches of a batch "
                           f"are gradient_accumulation_steps = {m})")]) from err
    runs = model.num_stages * v
    if runs > model.num_layers:
        raise ConfigError([(f"pipeline.virtual_stages: {v} chunks on each of {model.num_stages} stages cut "
                           f"the layers into {runs} runs, but the PipelineModule has {model.num_layers} "
                           "layers; each run needs one: use fewer virtual stages or more layers")])
    try:
        model.bind(mesh.coord("pp"), v)
    except PartitionError as err:
        raise ConfigError([f"pipeline.virtual_stages: {v} chunks x {model.num_stages} stages: {err}"]) from err
    _apply_checkpointing(model, cfg)
    return PipelineStep(model, mesh)


def _apply_checkpointing(model: PipelineModule, cfg: PipelineConfig) -> None:
    """The config's say on the layers' activation checkpointing, as DeepSpeed's engine has
    it: an interval above 0 replaces the module's, and `use_reentrant: false` picks the
    non-reentrant checkpoint whatever the interval (a later `set_checkpoint_interval` keeps it)."""
    if cfg.activation_checkpoint_interval > 0:
        model.set_checkpoint_interval(cfg.activation_checkpoint_interval)
    if not cfg.use_reentrant:
        model.activation_checkpoint_func = non_reentrant_checkpoint
