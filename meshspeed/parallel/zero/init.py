"""`meshspeed.zero.Init`: build a model whose parameters are partitioned as they are created.

    with meshspeed.zero.Init():
        model = GPT(cfg)          # no rank ever holds the whole model

Note [partitioned construction]
Inside the context, modules are created on the meta device (no memory). On exit, the
model is materialised one ZeRO-3 unit at a time (a transformer block, then the rest):
the unit's tensors are allocated, initialised with the same seed on every rank, this
rank's slice of each parameter is kept, and the full tensors are dropped. Peak memory is
the shards plus one unit. Initialisation calls the root module's
`init_module(name, module)` when it has one (the reference GPT does), else each module's
`reset_parameters()`; buffers are re-initialised the same way. Values therefore depend
on the order of units, not on the order a non-partitioned constructor would use.

No torch class is patched: the models created are found through torch's public module
registration hooks, and the slices wait in a registry (keyed by parameter, not stored on
it) until `meshspeed.initialize` builds the stage-3 units from them.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules import module as module_hooks
from torch.utils.weak import WeakIdKeyDictionary

from meshspeed import comm
from meshspeed.parallel.zero.grouping import module_units
from meshspeed.parallel.zero.layout import UnitLayout

# parameter -> this rank's padded chunk (1-D), for parameters built under Init
# keyed by identity: a WeakKeyDictionary would compare tensors with ==, elementwise
_SHARDS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def is_partitioned(param: nn.Parameter) -> bool:
    return param in _SHARDS


def take_shard(param: nn.Parameter) -> torch.Tensor:
    """The chunk built by Init for `param`; it leaves the registry."""
    return _SHARDS.pop(param)


def cast_partitioned(param: nn.Parameter, dtype: torch.dtype) -> None:
    _SHARDS[param] = _SHARDS[param].to(dtype)
    param.data = _empty_like_full(param.shape, dtype)


def gather_partitioned(param: nn.Parameter, group=None) -> None:
    """Make a parameter built under Init whole again (all ranks call this together)."""
    shard = take_shard(param)
    world = comm.get_world_size(group)
    full = torch.empty(world * shard.numel(), dtype=shard.dtype)
    comm.all_gather_into_tensor(full, shard, group=group)
    param.data = full[: param.numel()].view(param.shape).clone()


def _empty_like_full(shape, dtype) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype)
    t.untyped_storage().resize_(0)
    return t


class Init:
    """Partition parameters as modules are built (see Note [partitioned construction])."""

    def __init__(self, module: nn.Module | None = None, data_parallel_group=None,
                 config_dict_or_path=None, config=None, enabled: bool = True,
                 dtype: torch.dtype | None = None, remote_device=None, pin_memory: bool = False,
                 mpu=None, seed: int = 0):
        self.group = data_parallel_group
        self.enabled = enabled
        self.dtype = dtype
        self.seed = seed
        self.peak_materialized_bytes = 0
        self._module = module
        # modules seen while building, by identity and held weakly: an id() could be
        # reused by a later module once a temporary one is collected, and would then mark
        # a root as somebody's child (and leave it unpartitioned)
        self._parents: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._children: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def __enter__(self):
        if not self.enabled:
            return self
        if not comm.is_initialized():
            from meshspeed.runtime.distributed import init_distributed

            init_distributed()
        self._meta = torch.device("meta")
        self._meta.__enter__()
        self._handles = [
            module_hooks.register_module_module_registration_hook(self._on_submodule),
            module_hooks.register_module_parameter_registration_hook(self._on_parameter),
        ]
        return self

    def _on_submodule(self, module, name, submodule):
        self._parents[module] = True
        if submodule is not None:
            self._children[submodule] = True

    def _on_parameter(self, module, name, param):
        self._parents[module] = True

    def __exit__(self, exc_type, exc, tb):
        if not self.enabled:
            return False
        for h in self._handles:
            h.remove()
        self._meta.__exit__(exc_type, exc, tb)
        if exc_type is None:
            roots = [m for m in list(self._parents.keys()) if m not in self._children]
            for root in roots:
                self._materialize(root)
        self._parents.clear()
        self._children.clear()
        return False

    @torch.no_grad()
    def _materialize(self, root: nn.Module) -> None:
        rank, world = comm.get_rank(self.group), comm.get_world_size(self.group)
        plan = module_units(root, persistence_threshold=0)
        names = {id(m): n for n, m in root.named_modules()}
        done: set[int] = set()
        # meta parameter -> its real replacement (ties kept); keyed by identity, with the
        # meta parameter held so that its id cannot be reused meanwhile
        fresh: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}
        for index, unit in enumerate(plan.units):
            # the modules whose own tensors belong to this unit
            owners = unit.module.modules() if unit.module is not root else _non_block_modules(root, plan)
            modules = [m for m in owners if id(m) not in done]
            done.update(id(m) for m in modules)
            for m in modules:
                _materialize_own(m, fresh)
            torch.manual_seed(self.seed + index)  # same values on every rank
            for m in modules:
                _init_one(root, names.get(id(m), ""), m)
            self._note_peak(modules)
            params = list(dict.fromkeys(
                p for m in modules for p in m.parameters(recurse=False) if not is_partitioned(p)))
            layout = UnitLayout.build([("", tuple(p.shape)) for p in params], world)
            for lay, p in zip(layout.params, params):
                flat = p.detach().reshape(-1)
                chunk = torch.zeros(lay.chunk, dtype=self.dtype or p.dtype)
                n = lay.valid(rank)
                chunk[:n].copy_(flat[rank * lay.chunk : rank * lay.chunk + n])
                _SHARDS[p] = chunk
                p.data = _empty_like_full(p.shape, chunk.dtype)
        if self.dtype is not None:
            for b in root.buffers():
                if b.is_floating_point():
                    b.data = b.data.to(self.dtype)

    def _note_peak(self, modules) -> None:
        live = sum(t.untyped_storage().nbytes() for m in modules
                   for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)])
        self.peak_materialized_bytes = max(self.peak_materialized_bytes, live)


def _materialize_own(module: nn.Module, fresh: dict[int, tuple[nn.Parameter, nn.Parameter]]) -> None:
    """Replace a module's own meta tensors with real (uninitialised) CPU tensors."""
    for name, p in list(module._parameters.items()):
        if p is None or not p.is_meta:
            continue
        if id(p) not in fresh:
            fresh[id(p)] = (p, nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=p.requires_grad))
        setattr(module, name, fresh[id(p)][1])
    for name, b in list(module._buffers.items()):
        if b is not None and b.is_meta:
            module._buffers[name] = torch.empty(b.shape, dtype=b.dtype)


def _non_block_modules(root: nn.Module, plan) -> list[nn.Module]:
    in_blocks = {id(m) for u in plan.units if u.module is not root and u.module is not None
                 for m in u.module.modules()}
    return [m for m in root.modules() if id(m) not in in_blocks]


def _init_one(root: nn.Module, name: str, module: nn.Module) -> None:
    if hasattr(root, "init_module"):
        root.init_module(name, module)
    elif hasattr(module, "reset_parameters"):
        module.reset_parameters()
