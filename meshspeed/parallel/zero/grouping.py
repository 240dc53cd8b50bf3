"""Which parameters travel together: the communication units of ZeRO.

Stages 1 and 2 group parameters into buckets of at most `reduce_bucket_size` elements, in
reverse registration order (roughly the order backward produces gradients). Stage 3
groups by module: every element of an `nn.ModuleList` (a transformer block) is one unit,
so is every other module that alone registers parameters (Note [the root unit split]),
what is left forms the root unit, and small parameters below the persistence threshold
stay whole in a unit of their own.

Note [the root unit split]
A unit is whole only around its module's forward and backward (strategy.py's hooks). The
root unit's module is the model itself, so it is whole for all of forward and backward,
and its gradient is staged whole from the first gradient of backward to the last. Left
to hold the embedding and the head, it would be the largest thing gathered and staged
(for a GPT: 2 x vocab x d_model, against about 12 d_model^2 for a block). So a parameter
registered by exactly one module outside the blocks, other than the model itself, is a
unit of that module: the embedding is gathered before its forward and released after,
the head likewise (kept whole from the end of forward into the start of backward, as the
last unit of forward is), and each gradient is staged and reduced when its own backward
lands. The root keeps what no single submodule owns:
- parameters the model registers itself (a learned position table used in its forward);
- a parameter two modules register (a head tied to the embedding, one Parameter). It
  stays in the root rather than in a unit hooked on both modules: autograd accumulates
  the two uses' gradients into one `.grad` that lands with the embedding's backward, the
  last of the pass, so its staging buffer is alive from the head's backward to the end
  whatever the hooks do, and the head needs it whole at both ends of the pass. The tied
  root is one matrix (vocab x d_model), the size of the untied embedding or head alone,
  and its gradient is summed once, by autograd, before it is staged;
- parameters used outside their module (registered in external.py).
The largest unit outside the blocks, and so the largest staging term, is then one
vocab x d_model matrix, tied or not, where it was two untied
(meshspeed/planner/offload.py counts it so). The price is in gathers: the embedding is
gathered for its forward and again for its backward, and the last block, no longer the
last unit of forward (the head is), is released after its forward and gathered again
for its backward, as every other block is: two all-gathers more per step (with shards on
NVMe, two reads more: for the 2B GPT of docs/infinity.md, 134 MB and 101 MB of 16-bit
shard, against the 7.5 GB of its blocks' shards read twice). The collectives per step
grow likewise: each unit split off is an all-gather in forward, one in backward (not the
head's: it stays whole) and a reduce-scatter, where the root had one of each in all.
A model whose parent reads a child's weight directly in its own forward must register
that use (external.py), as under DeepSpeed, whose every module is gathered only around
its own forward.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from torch import nn

from meshspeed.parallel.buckets import split_by_numel

NamedParams = list[tuple[str, nn.Parameter]]


@dataclass
class UnitPlan:
    name: str
    params: NamedParams
    module: nn.Module | None = None  # the module whose forward brackets the unit's use (stage 3)
    shard_params: bool = False


@dataclass
class GroupingPlan:
    units: list[UnitPlan] = field(default_factory=list)

    @property
    def root(self) -> UnitPlan | None:
        return next((u for u in self.units if u.name == "root"), None)


def bucket_units(module: nn.Module, bucket_numel: int) -> GroupingPlan:
    """Stages 1-2: consecutive parameters (reverse order) up to `bucket_numel` elements."""
    named = reversed(list(module.named_parameters()))
    buckets = split_by_numel(named, bucket_numel, numel=lambda item: item[1].numel())
    return GroupingPlan([UnitPlan(f"bucket{i}", b) for i, b in enumerate(buckets)])


def block_modules(module: nn.Module, prefix: str = "") -> list[tuple[str, nn.Module]]:
    """Outermost elements of every nn.ModuleList below `module` (transformer blocks)."""
    blocks = []
    for name, child in module.named_children():
        path = f"{prefix}{name}"
        if isinstance(child, nn.ModuleList):
            blocks.extend((f"{path}.{i}", m) for i, m in enumerate(child))
        else:
            blocks.extend(block_modules(child, f"{path}."))
    return blocks


def module_units(module: nn.Module, persistence_threshold: int, numel=lambda p: p.numel(),
                 external: list[tuple[nn.Module, nn.Parameter]] = ()) -> GroupingPlan:
    """Stage 3: one sharded unit per block, one per other module that alone registers a
    parameter (the embedding, the head), a sharded root unit for the rest, and one whole
    persistent unit (Note [the root unit split]).

    `numel(p)` counts a parameter's elements (zero.Init's placeholders hold none); each
    `(m, p)` of `external` says that `m`'s forward uses `p` (external.py): a parameter
    used outside the module whose unit owns it stays in the root unit."""
    blocks = block_modules(module)
    claims = Counter(id(p) for _, m in blocks for p in m.parameters())
    in_blocks = {id(sub) for _, m in blocks for sub in m.modules()}
    outside = [(name, m) for name, m in module.named_modules() if id(m) not in in_blocks]
    # a parameter also registered by a module outside every block runs outside the
    # block's hooks: it must stay in the root unit, like one shared by several blocks
    claims.update(id(p) for _, m in outside for p in m.parameters(recurse=False) if id(p) in claims)
    shared = {pid for pid, n in claims.items() if n > 1}  # used by several owners: keep in root
    owner: dict[int, str] = {}
    for name, m in blocks:
        for p in m.parameters():
            if id(p) not in shared:
                owner.setdefault(id(p), name)
    # the rest: a parameter that one module outside the blocks registers (not the root
    # itself, not tied to a second module) is that module's, gathered around its use
    registrants = Counter(id(p) for _, m in outside for p in m.parameters(recurse=False))
    singles = [(name, m) for name, m in outside if m is not module]
    for name, m in singles:
        for p in m.parameters(recurse=False):
            if id(p) not in claims and registrants[id(p)] == 1:
                owner[id(p)] = name
    scope = {name: {id(sub) for sub in m.modules()} for name, m in blocks + singles}
    for user, p in external:
        if id(p) in owner and id(user) not in scope[owner[id(p)]]:
            del owner[id(p)]  # used outside its unit's module: root
    plans = {name: UnitPlan(name, [], m, shard_params=True) for name, m in blocks + singles}
    root = UnitPlan("root", [], module, shard_params=True)
    persistent = UnitPlan("persistent", [], None, shard_params=False)
    for name, p in module.named_parameters():
        if numel(p) <= persistence_threshold:
            persistent.params.append((name, p))
        else:
            plans.get(owner.get(id(p)), root).params.append((name, p))
    units = [u for u in plans.values() if u.params]
    units += [u for u in (root, persistent) if u.params]
    return GroupingPlan(units)


def split_experts(plan: GroupingPlan, is_expert) -> GroupingPlan:
    """Each unit with expert parameters split in two, the dense part and `<name>.experts`
    (same module): expert units communicate over another group (edp) than dense ones."""
    units = []
    for u in plan.units:
        expert = [(n, p) for n, p in u.params if is_expert(p)]
        dense = [(n, p) for n, p in u.params if not is_expert(p)]
        if expert and u.name == "root" and u.shard_params:
            # the root unit brackets the whole pass; a second root would need a second index
            raise ValueError("ZeRO stage 3: expert parameters fell into the root unit (shared by "
                             f"two modules, registered by the model itself, or used outside their "
                             f"module: {expert[0][0]}); keep each MoE layer's experts inside it")
        if dense:
            units.append(UnitPlan(u.name, dense, u.module, u.shard_params))
        if expert:
            units.append(UnitPlan(f"{u.name}.experts", expert, u.module, u.shard_params))
    return GroupingPlan(units)
