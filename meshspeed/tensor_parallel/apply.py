"""`apply_tensor_parallel(model, mesh, plan)`: swap a plain model's layers for tensor-parallel
ones, in place, after checking the whole plan against the model.

Order of work: find the tp axis; pick the plan (given, the model's own `tp_plan`, or the
Hugging Face auto plan); match and check every entry (nothing is split if anything is
wrong); then replace the matched modules in module order -- the vocab embedding before a
tied vocab_head, so the head can take the embedding's split Parameter -- and install the
sequence-parallel boundaries and the loss. Parameter names do not change: each layer keeps
its `weight`/`bias` attributes, the local shard of the logical parameter (`tp_shards`).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from meshspeed.tensor_parallel import (
    boundaries,
    layers,  # the other half of the package
)
from meshspeed.tensor_parallel.hf import after_split, hf_plan
from meshspeed.tensor_parallel.layers import SharedGather
from meshspeed.tensor_parallel.losses import install_loss
from meshspeed.tensor_parallel.plan import (
    HF_LOSS,
    KINDS,
    Assignment,
    PlanError,
    check,
    is_conv1d,
    normalize,
    resolve,
)
from meshspeed.topology.shards import shards_by_param


def apply_tensor_parallel(model: nn.Module, mesh: Any, plan: dict | None = None, *,
                          sequence_parallel: bool = False,
                          overlap_comm: bool = False, overlap_chunks: int = 4) -> nn.Module:
    """Split `model` over the tensor-parallel axis of `mesh`, in place; returns `model`.

    mesh: a `meshspeed.topology.Topology`, a DeviceMesh with a "tp" dimension, or a 1-D
    DeviceMesh. With tp == 1 the model is returned untouched.
    plan: {module-name glob: kind or {"kind": ..., options}} (see plan.py); None takes
    `model.tp_plan` (the reference GPT) or the automatic plan for a Hugging Face layout.
    sequence_parallel: the residual stream between blocks is split along the sequence
    (dim 1) and norms run on the shard (arXiv:2205.05198); parameters of sequence-sharded
    norms get partial gradients, listed in `module.tp_partial_grads`, which the caller
    sums over tp.
    overlap_comm: the layers cut their collectives into `overlap_chunks` pieces along the
    sequence so each piece's communication runs under the matmul of another (Note
    [overlapping tensor-parallel communication] in overlap.py): sequence-parallel
    all-gathers and reduce-scatters, and the all-reduce after a row layer in plain TP.
    Raises PlanError (a ConfigError) listing every problem before anything is split.
    """
    group, tp, _tp_rank = tp_axis(mesh)
    if tp == 1:
        return model
    if shards_by_param(model):
        raise PlanError(f"{type(model).__name__} is already tensor-parallel (it has split "
                        f"parameters); apply_tensor_parallel runs once per model")
    entries = normalize(plan if plan is not None else default_plan(model))
    assignments = resolve(model, entries)
    check(model, assignments, tp)
    _check_loss(assignments)
    if overlap_comm and (isinstance(overlap_chunks, bool) or not isinstance(overlap_chunks, int)
                         or overlap_chunks < 2):
        raise PlanError(f"overlap_chunks must be an integer >= 2 with overlap_comm, got {overlap_chunks!r}")
    _Splitter(model, group, tp, sequence_parallel, overlap_chunks if overlap_comm else 1).run(assignments)
    after_split(model, tp)
    return model


def tp_axis(mesh: Any) -> tuple[Any, int, int]:
    """(process group, tp size, this rank's tp coordinate) of a Topology or DeviceMesh."""
    if hasattr(mesh, "group") and hasattr(mesh, "coord"):  # meshspeed.topology.Topology
        return mesh.group("tp"), mesh.size("tp"), mesh.coord("tp")
    names = getattr(mesh, "mesh_dim_names", None)
    if hasattr(mesh, "get_group"):  # torch DeviceMesh
        if names and "tp" in names:
            mesh = mesh["tp"]
        elif mesh.ndim != 1:
            raise ValueError(f"a {mesh.ndim}-D DeviceMesh needs a 'tp' dimension for tensor "
                             f"parallelism; its dimensions are {names}")
        return mesh.get_group(), mesh.size(), mesh.get_local_rank()
    raise TypeError(f"mesh must be a meshspeed Topology or a torch DeviceMesh, got "
                    f"{type(mesh).__name__}")


def default_plan(model: nn.Module) -> dict:
    """The automatic plan for a known Hugging Face family, else the model's own `tp_plan`
    in meshspeed's form. (transformers models carry a `tp_plan` of their own, in HF's
    "colwise"/"rowwise" words, which is not this format and is not read.)"""
    auto = hf_plan(model)
    if auto is not None:
        return auto
    own = getattr(model, "tp_plan", None)
    if isinstance(own, dict) and own and all(
            (v if isinstance(v, str) else getattr(v, "kind", None) or v.get("kind")) in KINDS
            for v in own.values()):
        return own
    kind = getattr(getattr(model, "config", None), "model_type", None)
    family = f" (model_type {kind!r})" if kind else ""
    raise PlanError(f"no tensor-parallel plan for {type(model).__name__}{family}: pass "
                    f"plan={{module glob: 'column' | 'row' | 'vocab' | ...}} to "
                    f"apply_tensor_parallel, give the model a `tp_plan` attribute, or "
                    f"set tensor_parallel.partition_config.layer_specs in the config")


def _check_loss(assignments: list[Assignment]) -> None:
    heads = [a.name for a in assignments if a.entry.kind == "vocab_head"]
    losses = [a.name for a in assignments if a.entry.kind == "loss"]
    if losses and len(heads) != 1:
        raise PlanError(f"{losses[0]}: the vocab-parallel loss needs exactly one vocab_head "
                        f"in the plan, found {len(heads)} ({', '.join(heads) or 'none'})")


class _Splitter:
    """Replaces the assigned modules one by one (one job: build each layer)."""

    def __init__(self, model: nn.Module, group: Any, tp: int, sp: bool, chunks: int):
        self.model, self.group, self.tp, self.sp, self.chunks = model, group, tp, sp, chunks
        self.vocab: dict[int, nn.Module] = {}  # id(original embedding weight) -> new layer
        self.head: nn.Module | None = None
        self.gathers: dict[str, Any] = {}  # parent module name -> its columns' SharedGather
        self.gathered: list[str] = []  # modules whose input a boundary gathers (sp_input)
        self.columns_under: dict[str, int] = {}  # parent module name -> its column layers

    def run(self, assignments: list[Assignment]) -> None:
        self.gathered = [a.name for a in assignments if a.entry.sp_input == "gather"]
        for a in assignments:
            if a.entry.kind == "column":
                parent = a.name.rpartition(".")[0]
                self.columns_under[parent] = self.columns_under.get(parent, 0) + 1
        # Embeddings first: a tied head needs the embedding's new Parameter.
        first = sorted(assignments, key=lambda a: a.entry.kind != "vocab")
        for a in first:
            if a.entry.kind == "loss":
                continue
            module = self.model.get_submodule(a.name)
            new = self._build(a, module)
            if new is not module:
                _replace(self.model, a.name, new)
            boundaries.install(new, a.entry, self.group, self.sp)
        for a in assignments:
            if a.entry.kind == "loss":
                install_loss(self.model, a.name, self.head, self.group)

    def _sp(self, a: Assignment) -> bool:
        return self.sp if a.entry.sequence_parallel is None else self.sp and a.entry.sequence_parallel

    def _shared_gather(self, name: str, sp: bool) -> Any:
        """Sibling column layers under one parent share one sequence gather (q/k/v,
        gate/up), or in plain TP one input-gradient all-reduce (Note [one gather for
        sibling column layers]); SharedGather keys on the input tensor, so siblings that
        read different inputs simply gather each their own. Under a boundary that already
        gathered the input (sp_input="gather"), the gather is the boundary's. A column
        with no sibling gets None: it keeps its own collective, chunked for overlap."""
        if sp and any(name.startswith(g + ".") for g in self.gathered):
            return boundaries.ALREADY_GATHERED
        parent = name.rpartition(".")[0]
        if self.columns_under.get(parent, 0) < 2:
            return None
        if parent not in self.gathers:
            self.gathers[parent] = SharedGather(self.group, gather=sp)
        return self.gathers[parent]

    def _build(self, a: Assignment, module: nn.Module) -> nn.Module:
        kind, sp = a.entry.kind, self._sp(a)
        chunks = self.chunks
        if kind in ("column", "row"):
            layout = a.entry.weight_layout or ("in_out" if is_conv1d(module) else "out_in")
            kw = {"sequence_parallel": sp, "overlap_chunks": chunks, "weight_layout": layout}
            if kind == "row":
                return layers.RowParallelLinear.from_module(module, self.group, **kw)
            return layers.ColumnParallelLinear.from_module(
                module, self.group, parts=a.parts, multiple=a.multiple,
                gather_output=a.entry.gather_output, shared_gather=self._shared_gather(a.name, sp), **kw)
        if kind == "vocab":
            new = layers.VocabParallelEmbedding.from_module(module, self.group,
                                                            sequence_parallel=sp)
            self.vocab[id(module.weight)] = new
            return new
        if kind == "vocab_head":
            tied = self.vocab.get(id(module.weight))
            kw = {"sequence_parallel": sp, "overlap_chunks": chunks}
            if tied is not None:  # one Parameter, one shard, for embedding and head
                self.head = layers.ColumnParallelLinear.tied_to(tied, **kw)
            else:
                self.head = layers.ColumnParallelLinear.from_module(module, self.group, **kw)
            return self.head
        if kind == "sequence_norm":
            if self.sp:
                layers.mark_sequence_parallel(module)
            return module
        return module  # "replicate": boundary options only


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


__all__ = ["HF_LOSS", "PlanError", "apply_tensor_parallel", "default_plan", "tp_axis"]
