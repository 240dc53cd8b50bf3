"""`PipelineModule`: a model written as a list of layers, DeepSpeed's pipeline interface.

    net = PipelineModule(layers=[LayerSpec(nn.Linear, 8, 16), nn.ReLU(), LayerSpec(nn.Linear, 16, 2)],
                         loss_fn=nn.CrossEntropyLoss(), num_stages=2)

The layers are applied in order, each one's output the next one's input. They are cut into
`num_stages` contiguous runs (`partition.py`, `partition_method`), and each rank keeps only
the run of its pipeline stage: stage s is ranks [s * world / num_stages, (s + 1) * world /
num_stages), the mesh's pp axis (pipeline slowest, as in `meshspeed.topology.degrees`).

Note [only the owner builds]
A `LayerSpec` is built on the stage that owns it and nowhere else (its parameters are
counted on the meta device to cut the stages), so a model too big for one rank never
exists whole. Layers passed already built (`nn.Module`s, as DeepSpeed's examples do) exist
on every rank until this constructor returns; the ones another stage owns are dropped then
and not kept referenced. Parameters are registered under their global layer index ("3.weight"),
the names a one-stage module gives them, so checkpoints and parity tests line up across
pipeline degrees.

Note [tied layers across stages]
A `TiedLayerSpec` key names one module used at several positions (an embedding and the LM
head through its weight). Every stage owning a position builds the module (with
`seed_layers`, seeded by the key's first position, so all copies start equal; the engine
also broadcasts the first stage's copy to the others). The copies are separate tensors on
separate ranks: after each batch the engine sums their gradients over the stages holding
the key (`tied_stages()`), so every copy takes the same step, the one a single shared
module would take.

Interleaved schedules (`virtual_stages=v > 1`) cut the layers into p * v runs; stage s owns
runs s, s + p, s + 2p, ...: `chunks()` returns one callable per run, in that order.

Note [the mesh binds the stage]
The stage a rank runs is the mesh's pp coordinate, decided by `meshspeed.initialize`, and
nothing else. The constructor cannot wait for it: DeepSpeed scripts list
`net.parameters()` before initialize, so the module builds this rank's layers at once, for
the stage the launcher's rank implies (pipeline is the slowest mesh axis, so stage =
rank // (world / stages), `topology.degrees.pipeline_stage`), reading the process group if
one exists and the launcher's RANK / WORLD_SIZE otherwise, without starting one. At
initialize, `bind(stage, virtual_stages)` gives the mesh's coordinate and the config's
`pipeline.virtual_stages`; when either differs from the first build, the layers are cut
and built again from the list kept for that purpose, which is dropped then (so layers
passed already built, and alive on every rank anyway, live until initialize rather than
until the constructor returns). What the user listed for the optimizer or froze on the
first build follows each layer to its new stage (Note [model_parameters by name] in
meshspeed/optim/builder.py); values written into the first build's layers before
initialize do not: a rebuilt LayerSpec starts from its constructor (from its own seed
with `seed_layers`). The DeepSpeed `ProcessTopology` argument is read by the
DeepSpeed layer (`meshspeed.pipe.PipelineModule`), which turns it into `num_stages`.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from meshspeed import comm
from meshspeed.parallel.activation_checkpoint import checkpoint as _default_checkpoint
from meshspeed.parallel.pipeline.partition import partition
from meshspeed.parallel.pipeline.spec import LayerSpec, TiedLayerSpec
from meshspeed.parallel.zero.external import register as register_external_parameter
from meshspeed.topology.degrees import launch_hint, pipeline_stage

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec", "split_sequential"]


def _stages(num_stages: int | None) -> int:
    if num_stages is None:
        raise ValueError("PipelineModule needs num_stages=... (or, from DeepSpeed's API, topology=...)")
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"PipelineModule(num_stages={num_stages!r}): a positive integer")
    return num_stages


def _launched_world() -> tuple[int, int]:
    """(rank, world) without starting anything: the process group's, else the launcher's
    environment, else one process (Note [the mesh binds the stage])."""
    if comm.is_initialized():
        return comm.get_rank(), comm.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


class PipelineModule(nn.Module):
    """DeepSpeed's `PipelineModule`: this rank's stage of a list of layers (module docstring)."""

    def __init__(self, layers: Sequence[Any], num_stages: int | None = None,
                 loss_fn: Callable | None = None, seed_layers: bool = False,
                 seed_fn: Callable[[int], Any] | None = None, base_seed: int = 1234,
                 partition_method: str = "parameters", activation_checkpoint_interval: int = 0,
                 activation_checkpoint_func: Callable | None = None,
                 checkpointable_layers: list[str] | None = None, dynamic_shape: bool = False,
                 virtual_stages: int = 1):
        super().__init__()
        stages = _stages(num_stages)
        _check_virtual(virtual_stages)
        self.num_stages = stages
        self.loss_fn = loss_fn
        self.partition_method = partition_method
        self.dynamic_shape = dynamic_shape
        self.seed_layers, self.seed_fn, self.base_seed = seed_layers, seed_fn, base_seed
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.activation_checkpoint_func = activation_checkpoint_func
        self.checkpointable_layers = checkpointable_layers
        self.model_parallel_size: int | None = None  # the tp degree it was written for, if any
        self.num_layers = len(layers)
        self._layers: list[Any] | None = list(layers)  # until bind(): Note [the mesh binds the stage]
        self._tied_positions = _tied_positions(self._layers)
        # the cut first: it needs no processes, and a model that cannot be cut is the first
        # thing to say; bounds over p * v runs, run k belongs to stage k % p as its chunk k // p
        self.parts = partition(self._layers, stages * virtual_stages, partition_method)
        rank, world = _launched_world()
        if world % stages:
            raise ValueError(f"PipelineModule(num_stages={stages}) on {world} rank(s): the number of stages "
                             f"must divide the world size; {launch_hint(stages, world)}")
        self.global_rank, self.world_size = rank, world
        self._build(pipeline_stage(rank, world, stages), virtual_stages)

    def bind(self, stage: int, virtual_stages: int | None = None) -> None:
        """The stage and virtual stages the run uses, from the mesh and the config, at
        initialize (Note [the mesh binds the stage]): the layers are built again only when
        they differ from the constructor's."""
        virtual_stages = self.virtual_stages if virtual_stages is None else virtual_stages
        _check_virtual(virtual_stages)
        if (stage, virtual_stages) != (self.stage_id, self.virtual_stages):
            if self._layers is None:
                raise ValueError(f"PipelineModule already bound to stage {self.stage_id} with "
                                 f"{self.virtual_stages} virtual stage(s); cannot rebind to {stage}, "
                                 f"{virtual_stages}: build a new PipelineModule")
            for name in [n for n, _ in self.named_children() if n.isdigit()]:  # layers by index
                delattr(self, name)
            self.parts = partition(self._layers, self.num_stages * virtual_stages, self.partition_method)
            self._build(stage, virtual_stages)
        self._layers = None  # Note [only the owner builds]: no reference to other stages' layers

    def _build(self, stage: int, virtual_stages: int) -> None:
        self.stage_id, self.virtual_stages = stage, virtual_stages
        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs: dict[str, list[str]] = {}
        self._chunks: list[_Chunk] = []
        for chunk in range(virtual_stages):
            run = chunk * self.num_stages + stage
            lo, hi = self.parts[run], self.parts[run + 1]
            funcs, names = [], []
            for index in range(lo, hi):
                layer = self._layers[index]
                if self.seed_layers:
                    (self.seed_fn or torch.manual_seed)(self.base_seed + self._seed_index(layer, index))
                func, name = self._place(index, layer)
                funcs.append(func)
                names.append(name)
            self._chunks.append(_Chunk(self, chunk, run, list(range(lo, hi)), funcs, names))
        self.forward_funcs = [f for c in self._chunks for f in c.funcs]

    # -- building ------------------------------------------------------------------------------
    def _seed_index(self, layer: Any, index: int) -> int:
        """Tied copies are seeded by the key's first position, so they start equal."""
        if isinstance(layer, TiedLayerSpec):
            return self._tied_positions[layer.key][0]
        return index

    def _place(self, index: int, layer: Any) -> tuple[Callable, str | None]:
        """Register `layer` at position `index`; return what forward calls there."""
        if isinstance(layer, TiedLayerSpec):
            if layer.key not in self.tied_modules:
                self.tied_modules[layer.key] = layer.build()
                self.tied_weight_attrs[layer.key] = layer.tied_weight_attr
            module = self.tied_modules[layer.key]
            if layer.forward_fn is not None:
                # forward_fn reads the module's weights outside the module's own forward (the
                # tied head's F.linear): under ZeRO stage 3 they must stay in the root unit,
                # not in a unit of their module (Note [the root unit split] in zero/grouping.py)
                for p in module.parameters():
                    register_external_parameter(self, p)
            func = functools.partial(layer.forward_fn, module) if layer.forward_fn else module
            return func, type(module).__name__
        if isinstance(layer, LayerSpec):
            layer = layer.build()
        if isinstance(layer, nn.Module):
            self.add_module(str(index), layer)
            return layer, type(layer).__name__
        if callable(layer):  # a plain function between layers, e.g. a flatten
            return layer, None
        raise TypeError(f"PipelineModule layer {index}: expected an nn.Module, LayerSpec or callable, "
                        f"got {type(layer).__name__}")

    def set_checkpoint_interval(self, interval: int) -> None:
        """Checkpoint every `interval` layers from now on (0: none)."""
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 0:
            raise ValueError(f"set_checkpoint_interval({interval!r}): a number of layers, 0 or more")
        self.activation_checkpoint_interval = interval

    # -- what the engine asks ------------------------------------------------------------------
    def num_pipeline_stages(self) -> int:
        return self.num_stages

    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def chunks(self) -> list[_Chunk]:
        """This stage's runs of layers, in schedule chunk order (one unless interleaved)."""
        return list(self._chunks)

    def stage_layers(self, stage: int | None = None) -> range:
        """Global indices of the layers a stage owns (with one chunk per stage)."""
        s = self.stage_id if stage is None else stage
        if self.virtual_stages != 1:
            raise ValueError("stage_layers() with virtual_stages > 1: use chunks()")
        return range(self.parts[s], self.parts[s + 1])

    def tied_stages(self) -> dict[str, list[int]]:
        """For every tied key: the stages holding a copy (Note [tied layers across stages])."""
        out = {}
        for key, positions in self._tied_positions.items():
            runs = {next(k for k in range(len(self.parts) - 1) if self.parts[k] <= i < self.parts[k + 1])
                    for i in positions}
            out[key] = sorted({k % self.num_stages for k in runs})
        return out

    def get_tied_weights(self) -> dict[str, list[nn.Parameter]]:
        """This stage's tied tensors per key (empty for keys it does not hold)."""
        return {key: [self.tied_modules[key].get_parameter(attr) for attr in attrs]
                for key, attrs in self.tied_weight_attrs.items()}

    # -- running ---------------------------------------------------------------------------------
    def forward(self, forward_input: Any, chunk: int | None = None) -> Any:
        """Run this stage's layers (one chunk of them under an interleaved schedule). Every
        chunk runs through here, so hooks on the module (ZeRO-3's gathers) bracket it."""
        if chunk is None:
            if len(self._chunks) != 1:
                raise RuntimeError("PipelineModule with virtual_stages > 1 runs chunk by chunk: "
                                   "net(x, chunk=c), or the engine's train_batch")
            chunk = 0
        c = self._chunks[chunk]
        return self._run(c.funcs, c.names, forward_input)

    def _run(self, funcs: Sequence[Callable], names: Sequence[str | None], x: Any) -> Any:
        interval = self.activation_checkpoint_interval
        if interval <= 0 or not (self.training and torch.is_grad_enabled()):
            return _run(funcs, x)
        for start in range(0, len(funcs), interval):
            block_funcs, block_names = funcs[start : start + interval], names[start : start + interval]
            if not self._checkpointable(block_funcs, block_names):
                x = _run(block_funcs, x)
                continue
            args = x if isinstance(x, tuple) else (x,)
            block = functools.partial(_run_args, block_funcs, isinstance(x, tuple))
            x = (self.activation_checkpoint_func or _default_checkpoint)(block, *args)
        return x

    def _checkpointable(self, funcs: Sequence[Callable], names: Sequence[str | None]) -> bool:
        """Recompute a block only if it holds parameters (else there is nothing to save)
        and, with `checkpointable_layers`, one of the named layer classes."""
        if self.checkpointable_layers is not None:
            return any(name in self.checkpointable_layers for name in names)
        return any(isinstance(f, nn.Module) and any(True for _ in f.parameters()) for f in funcs)


class _Chunk:
    """One contiguous run of a stage's layers: a callable the schedule runs (not a module:
    its layers are registered once, on the PipelineModule)."""

    def __init__(self, owner: PipelineModule, index: int, run: int, indices: list[int],
                 funcs: list[Callable], names: list[str | None]):
        self._owner, self.index, self.run, self.indices = owner, index, run, indices
        self.funcs, self.names = funcs, names

    def __call__(self, x: Any) -> Any:
        return self._owner(x, chunk=self.index)

    def parameters(self):
        seen = set()
        for f in self.funcs:
            module = f.args[0] if isinstance(f, functools.partial) and f.args else f
            if isinstance(module, nn.Module):
                for p in module.parameters():
                    if id(p) not in seen:
                        seen.add(id(p))
                        yield p

    def __repr__(self) -> str:
        return f"_Chunk(run {self.run}: layers {self.indices[0]}..{self.indices[-1]})"


def _tied_positions(layers: Sequence[Any]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i, layer in enumerate(layers):
        if isinstance(layer, TiedLayerSpec):
            out.setdefault(layer.key, []).append(i)
    return out


def _check_virtual(virtual_stages: Any) -> None:
    if isinstance(virtual_stages, bool) or not isinstance(virtual_stages, int) or virtual_stages < 1:
        raise ValueError(f"PipelineModule(virtual_stages={virtual_stages!r}): a positive integer")


def _run(funcs: Sequence[Callable], x: Any) -> Any:
    for f in funcs:
        x = f(x)
    return x


def _run_args(funcs: Sequence[Callable], as_tuple: bool, *args: Any) -> Any:
    return _run(funcs, args if as_tuple else args[0])


def split_sequential(model: nn.Module, num_stages: int, module_class: type | None = None,
                     **kwargs: Any) -> PipelineModule:
    """A PipelineModule over the children of a sequential model (nn.Sequential, or any
    module whose forward applies its children in order): ``split_sequential(net, 2,
    loss_fn=nn.CrossEntropyLoss())``. Other PipelineModule arguments pass through."""
    children = list(model.children())
    if not children:
        raise ValueError(f"split_sequential: {type(model).__name__} has no child modules to split")
    kwargs.setdefault("loss_fn", getattr(model, "loss_fn", None))
    return (module_class or PipelineModule)(children, num_stages=num_stages, **kwargs)
