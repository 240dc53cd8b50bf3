"""ZeRO stages 1-3 composed from units, the stage table, a placement and (stage 3) the fetcher.

Every unit is a `FlatUnit` (flat.py, Note [flat units]). Stages 1 and 2 group consecutive
parameters in reverse registration order (about the order backward produces gradients),
at most `unit_numel(...)` elements each. Stage 3 makes one sharded unit per block, one
per other module that alone owns parameters (the embedding, the head: Note [the root unit
split] in grouping.py), a sharded root unit for the rest, and one whole unit for the
parameters below the persistence threshold (gradients reduced as in stage 2). The engine drives the strategy through
meshspeed/parallel/protocol.py.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from meshspeed import comm
from meshspeed.parallel import registry
from meshspeed.parallel.experts import ExpertSpec
from meshspeed.parallel.protocol import (
    ExternalParameters,
    GatheredCache,
    HandsOver,
    ParameterOwner,
    Strategy,
)
from meshspeed.parallel.readiness import ReadinessTracker
from meshspeed.parallel.slices import OwnedSlice, ParamAccess
from meshspeed.parallel.step import StepGradients
from meshspeed.parallel.weak import weak_method
from meshspeed.parallel.zero import ds_params
from meshspeed.parallel.zero.ds_params import PartitionView, ZeroParamStatus
from meshspeed.parallel.zero.external import external_uses
from meshspeed.parallel.zero.flat import FlatUnit, publish_all
from meshspeed.parallel.zero.flat_cache import FlatCache, available
from meshspeed.parallel.zero.grouping import GroupingPlan, bucket_units, module_units, split_experts
from meshspeed.parallel.zero.groups import UnitGroups
from meshspeed.parallel.zero.init_shards import full_numel, gather_partitioned, is_partitioned
from meshspeed.parallel.zero.lifecycle import LifecycleError, ParamState
from meshspeed.parallel.zero.placement import DevicePlacement
from meshspeed.parallel.zero.prefetch import Fetcher, Pass, attach_pre_backward
from meshspeed.parallel.zero.stages import STAGES
from meshspeed.parallel.zero.staging import StagingPool
from meshspeed.process.progress import progress

# Note [unit size for stages 1 and 2]
# A unit is what one reduce-scatter and one all-gather move. Stage 2 holds the full
# gradients of at most a few units at once (Note [staging pool]), so a unit of the whole
# model would hold the whole model's gradients, which is what stage 2 exists to avoid.
# Units are therefore at most `reduce_bucket_size` elements and at most an eighth of the
# model, but never under 2^18 elements (1 MiB in fp32), below which per-collective
# latency dominates.
MIN_UNIT_NUMEL = 1 << 18
UNITS_PER_MODEL = 8
IN_FLIGHT = 1


def unit_numel(total_numel: int, reduce_bucket_size: int) -> int:
    """Most elements in one stage-1/2 unit (Note [unit size for stages 1 and 2])."""
    share = -(-total_numel // UNITS_PER_MODEL)
    return max(1, min(reduce_bucket_size, max(share, MIN_UNIT_NUMEL)))


# a unit's state as DeepSpeed's p.ds_status names it (ds_params.py)
_DS_STATUS = {ParamState.WHOLE: ZeroParamStatus.AVAILABLE, ParamState.GATHERING: ZeroParamStatus.INFLIGHT,
              ParamState.SHARDED: ZeroParamStatus.NOT_AVAILABLE}


class Zero(Strategy, ParameterOwner, ExternalParameters, GatheredCache, HandsOver):
    def __init__(
        self,
        module: nn.Module,
        groups: UnitGroups | None = None,
        *,
        stage: int,
        bucket_numel: int = 500_000_000,
        persistence_threshold: int = 100_000,
        prefetch_numel: int = 50_000_000,
        max_live_numel: int = 1_000_000_000,
        comm_dtype: torch.dtype = torch.float32,
        placement=None,
        experts: ExpertSpec | None = None,
        weight_block: int | None = None,
        grad_block: int | None = None,
    ):
        """`weight_block`: ZeRO++ qwZ, stage 3 only: the parameter all-gathers of forward
        and backward move INT8 weights with one fp32 scale per this many elements (qwz.py);
        None gathers the shards as they are. `grad_block`: ZeRO++ qgZ, stages 2-3: each
        unit's gradient reduce-scatter becomes an all-to-all of INT4 shards with one fp32
        scale per this many elements (qgz.py); None reduce-scatters as they are."""
        if stage not in (1, 2, 3):
            raise ValueError(f"Zero handles stages 1-3, got {stage}")
        if weight_block is not None and not STAGES[stage].shard_params:
            raise ValueError(f"quantized weight gathers (qwZ) need stage 3; stage {stage} gathers no parameters")
        if grad_block is not None and not STAGES[stage].shard_grads:
            raise ValueError(f"quantized gradient reduction (qgZ) needs stage 2 or 3; stage {stage} "
                             "reduces its full gradients once per step")
        self.weight_block = weight_block
        self.grad_block = grad_block
        self.stage = stage
        self.spec = STAGES[stage]
        self.module = module
        self.groups = groups if isinstance(groups, UnitGroups) else UnitGroups(shard=groups)
        # Note [expert parameters in the strategies]: expert units shard over edp
        self.experts = experts
        self.expert_groups = None if experts is None else \
            UnitGroups(shard=experts.group, average_over=experts.dp_size)
        self.placement = placement or DevicePlacement()
        self._hooks: list = []  # module hook handles, removed by hand_over
        self.handed_over = False
        self._gather_built_under_init(module, persistence_threshold)
        self._broadcast_stage3_params(module, persistence_threshold)
        device = next(module.parameters()).device
        self.pool = StagingPool(comm_dtype, device)
        if self.spec.shard_params:
            plan: GroupingPlan = module_units(module, persistence_threshold, numel=full_numel,
                                              external=external_uses(module))
        else:
            total = sum(p.numel() for p in module.parameters())
            plan = bucket_units(module, unit_numel(total, bucket_numel))
        if experts is not None:
            plan = split_experts(plan, experts.holds)  # units never mix expert and dense
        self.master_of: dict[int, nn.Parameter] = {}
        self.units: list[FlatUnit] = []
        with progress(len(plan.units), f"ZeRO stage {stage}: building the units", unit="unit") as bar:
            for u in plan.units:
                # placed before the next is built (Note [units placed as they are built] in
                # meshspeed/offload/placement.py): the init peak is one unit, not the model
                self.units.append(self._make_unit(u, comm_dtype))
                self.placement.unit_built(self, self.units[-1])
                bar.update()
        self.flat_cache = None  # Note [gathered buffers without fresh pages] in flat_cache.py
        if self.spec.shard_params and self.units and available(device):
            self.flat_cache = FlatCache(max(u.layout.padded_numel * u.flat.element_size()
                                            for u in self.units))
            for unit in self.units:
                unit.flat_cache = self.flat_cache
        self.master_of = {
            id(p): m for unit in self.units for p, m in zip(unit.params, unit.masters)
        }
        self.tracker = ReadinessTracker([u.params for u in self.units], weak_method(self._reduce_unit),
                                        on_param=weak_method(self._on_grad))
        self.unit_of = {id(p): unit for unit in self.units for p in unit.params}
        self.index_in_unit = {id(p): i for unit in self.units for i, p in enumerate(unit.params)}
        registry.register(module.parameters(), self)
        self.boundary = True
        self._accumulated = False  # a backward ran since the last step
        self._pending: list = []  # (unit, finish) of reduce-scatters in flight
        self.fetcher = None
        self.root_index: int | None = None
        if self.spec.shard_params:
            sharded = [i for i, u in enumerate(self.units) if u.shard_params]
            self.fetcher = Fetcher([self.units[i] for i in sharded], prefetch_numel, max_live_numel)
            self._fetch_index = {i: k for k, i in enumerate(sharded)}  # unit -> fetcher index
            self._install_module_hooks(plan)
            self._unit_module = {id(u): pl.module for pl, u in zip(plan.units, self.units)}
            ds_params.expose(module.parameters(), self)  # DeepSpeed's p.ds_* (ds_params.py)
        self.placement.bind(self)

    def _groups_of(self, param: nn.Parameter) -> UnitGroups:
        """The groups of `param`'s unit: expert parameters' edp, or the strategy's."""
        if self.experts is not None and self.experts.holds(param):
            return self.expert_groups
        return self.groups

    def _make_unit(self, plan, comm_dtype) -> FlatUnit:
        groups = self._groups_of(plan.params[0][1])  # a unit is all expert or all dense
        unit = FlatUnit(plan.name, plan.params, groups, shard_params=plan.shard_params,
                        keep_full_grads=not self.spec.shard_grads, pool=self.pool, comm_dtype=comm_dtype,
                        weight_block=self.weight_block, grad_block=self.grad_block)
        if not plan.shard_params:
            unit.broadcast_from(0)  # every replica starts from the first rank's values
        return unit

    def _gather_built_under_init(self, module: nn.Module, persistence_threshold: int) -> None:
        """Parameters built by zero.Init that this stage keeps whole are gathered once."""
        for p in module.parameters():
            keep_whole = not self.spec.shard_params or full_numel(p) <= persistence_threshold
            if is_partitioned(p) and keep_whole:
                gather_partitioned(p)

    def _broadcast_stage3_params(self, module: nn.Module, persistence_threshold: int) -> None:
        """Stage 3: replicas start from the first rank's values before they are sliced.
        Parameters that stay whole (at most `persistence_threshold` elements, the rule of
        `module_units`) go into a flat unit, which broadcasts its own buffer; zero.Init
        slices are already agreed."""
        if not self.spec.shard_params:
            return
        for p in module.parameters():
            if is_partitioned(p) or p.numel() <= persistence_threshold:
                continue
            groups = self._groups_of(p)
            comm.broadcast(p.data, src=0, group=groups.shard)
            if groups.replicate is not None:
                comm.broadcast(p.data, src=0, group=groups.replicate)

    # -- stage 3 module hooks -------------------------------------------------------------
    def _install_module_hooks(self, plan: GroupingPlan) -> None:
        # the root's hooks bracket every pass (and record the unit order for prefetch) even
        # when the root owns no sharded parameter of its own
        self._hooks.append(self.module.register_forward_pre_hook(weak_method(self._root_pre_forward)))
        self._hooks.append(self.module.register_forward_hook(weak_method(self._root_post_forward)))
        for index, (unit_plan, unit) in enumerate(zip(plan.units, self.units)):
            if not unit.shard_params:
                continue
            fetch_index = self._fetch_index[index]
            if unit_plan.module is self.module:  # root: whole for the entire forward+backward
                self.root_index = fetch_index
            else:
                self._hooks.append(unit_plan.module.register_forward_pre_hook(
                    weak_method(self._pre_forward, fetch_index)))
                self._hooks.append(unit_plan.module.register_forward_hook(
                    weak_method(self._post_forward, fetch_index)))

    def _root_pre_forward(self, module, args):
        self.fetcher.start(Pass.FORWARD)
        if self.root_index is not None:
            self.fetcher.fetch(self.root_index, Pass.FORWARD)

    def _root_post_forward(self, module, args, output):
        self.fetcher.finish(Pass.FORWARD)
        if not torch.is_grad_enabled():
            self.fetcher.release_all()  # inference: nothing will come back for backward
            return output
        self.fetcher.start(Pass.BACKWARD)
        if self.root_index is not None:
            # the root's parameters are whole through forward and backward; with several
            # forwards in flight (pipeline schedules, or any forward-forward-backward-backward)
            # an earlier backward's end released them, so each backward gathers them again
            return attach_pre_backward(output, partial(self.fetcher.fetch, self.root_index, Pass.BACKWARD))
        return output

    def _pre_forward(self, index, module, args):
        self.fetcher.fetch(index, Pass.FORWARD)
        self.fetcher.units[index].in_use += 1

    def _post_forward(self, index, module, args, output):
        self.fetcher.units[index].in_use -= 1
        training = torch.is_grad_enabled()
        if not (training and self.fetcher.last_in_forward(index)):
            self.fetcher.release(index)
        # else: the last unit of forward (the head, when it is a unit of its own: Note [the
        # root unit split] in grouping.py; else the last block) is the first of backward;
        # keeping it whole saves releasing and re-gathering it back to back
        if training:
            return attach_pre_backward(output, partial(self.fetcher.fetch, index, Pass.BACKWARD))
        return output  # (inference: every unit was released above)

    # -- backward -------------------------------------------------------------------------
    def hand_over(self) -> None:
        """A later initialize on this module takes its parameters (HandsOver)."""
        if self.handed_over:
            return
        self.flush()
        params = [p for unit in self.units for p in unit.params]
        gathered = self.gather_for_user(params)  # collective, in unit order on every rank
        whole = [p.data.detach().clone() for p in params]
        self.release_for_user(gathered)
        for p, values in zip(params, whole):
            p.data = values  # no longer a view of this strategy's buffers
        for handle in self._hooks + self.tracker.handles:
            handle.remove()
        self._hooks, self.tracker.handles = [], []
        self.handed_over = True

    def _check_not_handed_over(self) -> None:
        if self.handed_over:
            raise RuntimeError(
                "this engine's model was passed to a later initialize, which took its "
                "parameters over; train with the engine that call returned")

    def begin_micro_step(self, boundary: bool, loss_scale: float = 1.0) -> None:
        self._check_not_handed_over()
        self.boundary = boundary
        files = self.placement.deferred_grads()
        if files is not None:  # gradients land in files, unscaled on the way
            files.loss_scale = loss_scale
        # stage 1 reduces once per step, from full gradients accumulated over micro-steps
        # (at the boundary backward, as each unit completes); stages 2-3 reduce every
        # micro-step and keep only the owned, accumulated slice
        self.tracker.arm(self.spec.shard_grads or boundary)

    def hold_reductions(self) -> None:
        self.tracker.arm(False)  # gradients accumulate in .grad; the next boundary reduces them

    def _on_grad(self, index: int, param_index: int) -> None:
        unit = self.units[index]
        if unit.grads is None:
            unit.receive_grad(param_index)  # staged and freed as it arrives

    def _reduce_unit(self, index: int) -> None:
        """The unit's gradients are complete: launch their reduce-scatter, which runs in
        the background while backward continues; the full gradients (and, under stage 3,
        the full parameters) are freed right away."""
        unit = self.units[index]
        self._pending.append((unit, unit.launch_reduce_scatter()))
        if unit.shard_params and unit is not self._root_unit() and unit.state is not ParamState.SHARDED:
            unit.release()
        while len(self._pending) > IN_FLIGHT:  # keep reductions in flight, settle the older ones
            self._settle_one()

    def _root_unit(self):
        return None if self.root_index is None else self.fetcher.units[self.root_index]

    def _settle_one(self) -> None:
        unit, finish = self._pending.pop(0)
        finish()  # the unit's grad_shard now holds (or has accumulated) its reduced shard
        if self.boundary:
            self.placement.grad_shard_ready(unit)

    def _settle_reductions(self) -> None:
        while self._pending:
            self._settle_one()

    def finish_backward(self) -> None:
        self.tracker.flush()
        self._settle_reductions()
        self._accumulated = True
        if self.fetcher is not None:
            self.fetcher.finish(Pass.BACKWARD)
            self.fetcher.release_all()

    def drop_unreduced(self) -> None:
        held = [u for u in self.units if u.grads is not None and u.grad_shard is None]
        if self._accumulated and held:  # stage 1 before the boundary's reduction
            for unit in held:
                unit.grads.bind()
            self._accumulated = False

    # -- step -----------------------------------------------------------------------------
    def prepare_step(self) -> StepGradients:
        self._check_not_handed_over()
        if self.flat_cache is not None:
            self.flat_cache.clear()  # (Note [gathered buffers without fresh pages])
        self.placement.before_step(self)
        self.placement.attach_grads(self.units)
        # expert shards: distinct over edp (sharded) and over ep (other experts), so
        # summing over all of dp counts each element once, as for dense shards
        return StepGradients(self.masters(), groups=[self.groups.shard],
                             files=self.placement.deferred_grads())

    def masters(self) -> list[nn.Parameter]:
        return [m for unit in self.units for m in unit.masters]

    def finish_step(self) -> None:
        self.placement.finish_step(self)
        self._accumulated = False

    @property
    def shards_params(self) -> bool:
        return self.spec.shard_params

    def flush(self) -> None:
        self.placement.flush(self)

    def close(self) -> None:
        self.placement.close()
        if self.flat_cache is not None:
            self.flat_cache.clear()

    # -- checkpoint contract ----------------------------------------------------------------
    def owned_slices(self) -> list[OwnedSlice]:
        self.placement.wait()  # masters are final once a running update is done
        out = []
        names = self.experts.names if self.experts is not None else {}
        for unit in self.units:
            for name, shape, p, s, m in zip(unit.names, unit.shapes, unit.params, unit.spans, unit.masters):
                name = names.get(id(p), name)  # experts: by global expert id
                out.append(OwnedSlice(name, shape, unit.dtype, s.start, s.start + s.numel, m, m, True,
                                      p.requires_grad, swap=self.placement.swapped_master(m)))
        return out

    def sync_params_from_masters(self) -> None:
        """Masters were overwritten (checkpoint load): rebuild parameters from them."""
        self.placement.wait()
        publish_all(self.units)
        self.placement.published()

    def release_gathered(self) -> None:
        """Shard again every stage-3 unit a pass left whole (the last block of a training
        forward, kept for its backward; the root's parameters). A backward still to come
        gathers them again; nothing to do at stages 1-2."""
        if self.fetcher is None:
            return
        running = [u.name for u in self.fetcher.units if u.in_use]
        if running:
            raise LifecycleError(f"empty_partition_cache() called inside the forward of unit {running[0]}; "
                                 "call it between steps")
        self.fetcher.release_all()

    # -- GatheredParameters ----------------------------------------------------------------
    def gather_for_user(self, params: list[nn.Parameter]) -> list[FlatUnit]:
        """Make the units holding `params` whole; returns the ones this call gathered."""
        gathered = []
        for unit in self._units_of(params):
            if unit.shard_params and unit.state is not ParamState.WHOLE:
                unit.gather(exact=True)  # the user sees the shards' values, never qwZ's
                gathered.append(unit)
        return gathered

    def publish_user_changes(self, params: list[nn.Parameter], src_rank: int) -> None:
        for p in params:
            comm.broadcast(p.data, src=src_rank, group=self._groups_of(p).shard)
        for unit in self._units_of(params):
            unit.refresh_from_params()

    def release_for_user(self, gathered: list[FlatUnit]) -> None:
        for unit in gathered:
            unit.release(for_user=True)  # what the user took inside the block stays valid

    # -- user access (DeepSpeed's p.ds_* and safe_get_* helpers) -------------------------------
    def partition_view(self, param: nn.Parameter) -> PartitionView:
        unit, i = self.unit_of[id(param)], self.index_in_unit[id(param)]
        s = unit.spans[i]
        return PartitionView(_DS_STATUS[unit.state], torch.Size(unit.shapes[i]),
                             unit.shard[s.offset : s.offset + s.numel])

    def param_access(self, param: nn.Parameter) -> ParamAccess:
        self.placement.wait()  # a delayed update still running would change the masters
        unit, i = self.unit_of[id(param)], self.index_in_unit[id(param)]
        s, master = unit.spans[i], self.master_of[id(param)]
        grad, local, copied = None, False, False
        files = self.placement.deferred_grads()
        if files is not None and param.requires_grad and files.has_landed(unit):
            grad, copied = files.read(unit, s.offset, s.numel), True  # a copy read from its file
        elif unit.grad_shard is not None and param.requires_grad:
            grad = unit.grad_shard[s.offset : s.offset + s.numel]
        elif unit.grads is not None and self._accumulated and param.grad is not None:
            # stage 1 before the boundary's reduction: the whole local gradient (Note [local
            # gradients before the reduction] in meshspeed/parallel/access.py)
            grad, local = param.grad.reshape(-1), True
        values, publish = master.detach(), unit.refresh_from_masters
        swap = self.placement.swapped_master(master)
        if swap is not None:  # a copy read from the file; publish writes it back first
            values = swap.read()

            def publish(values=values, swap=swap, unit=unit):
                swap.write(values)
                unit.refresh_from_masters()

        return ParamAccess(torch.Size(unit.shapes[i]), s.start, s.start + s.numel, values, master,
                           grad, True, unit.groups.shard, publish, local, copied)

    def check_external(self, module: nn.Module, param: nn.Parameter) -> None:
        """A use registered after initialize must need no regrouping (external.py)."""
        unit = self.unit_of.get(id(param))
        owner = None if unit is None or not unit.shard_params else self._unit_module.get(id(unit))
        if owner is None or owner is self.module or any(m is module for m in owner.modules()):
            return  # whole whenever `module` runs already
        raise RuntimeError(
            f"register_external_parameter after meshspeed.initialize: the parameter belongs to unit "
            f"{unit.name}, which is gathered only while its own module runs; register the use before "
            "initialize (e.g. in the module's __init__) so that it is kept in the root unit")

    def _units_of(self, params):
        return list({id(self.unit_of[id(p)]): self.unit_of[id(p)] for p in params}.values())

    # -- accounting -----------------------------------------------------------------------
    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        return {
            "params": [t for u in self.units for t in u.param_tensors()] + self.placement.param_staging(),
            "gathered_params": [t for u in self.units for t in u.gathered_tensors()],
            # fp32 training: masters alias the params (or the stage-3 shard), nothing extra
            "master_params": [u.master_buffer for u in self.units if u.master_buffer is not None],
            "grads": [t for u in self.units for t in u.grad_tensors()] + self.placement.extra_grads(),
            "comm_buffers": self.pool.tensors() + [t for u in self.units for t in u.comm_tensors()]
            + self.placement.grad_staging() + ([] if self.flat_cache is None else self.flat_cache.tensors()),
        }

    def host_tensors(self) -> list[torch.Tensor]:
        return self.placement.host_tensors(self)

    def nvme_bytes(self) -> dict[str, int]:
        return self.placement.nvme_bytes()

    def peak_gathered_bytes(self) -> int:
        return 0 if self.fetcher is None else self.fetcher.peak_gathered_bytes

