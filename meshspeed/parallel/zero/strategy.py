"""ZeRO stages 1-3 composed from units, the stage table and (stage 3) the fetcher.

The engine drives a strategy through one small protocol, shared with data parallelism:
`begin_micro_step(boundary)`, `finish_backward()`, `prepare_step() -> masters`,
`finish_step()`, `masters()`, `grads_are_sharded()`, `memory_tensors()`.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from meshspeed import comm
from meshspeed.parallel import registry
from meshspeed.parallel.readiness import ReadinessTracker
from meshspeed.parallel.slices import OwnedSlice
from meshspeed.parallel.zero.grouping import GroupingPlan, bucket_units, module_units
from meshspeed.parallel.zero.init import gather_partitioned, is_partitioned
from meshspeed.parallel.zero.prefetch import Fetcher, Pass, attach_pre_backward
from meshspeed.parallel.zero.stages import STAGES
from meshspeed.parallel.zero.unit import ParamState, ZeroUnit


class Zero:
    def __init__(
        self,
        module: nn.Module,
        group,
        *,
        stage: int,
        bucket_numel: int = 500_000_000,
        persistence_threshold: int = 100_000,
        prefetch_numel: int = 50_000_000,
        max_live_numel: int = 1_000_000_000,
        comm_dtype: torch.dtype = torch.float32,
    ):
        if stage not in (1, 2, 3):
            raise ValueError(f"Zero handles stages 1-3, got {stage}")
        self.stage = stage
        self.spec = STAGES[stage]
        self.module = module
        self.group = group
        self._gather_built_under_init(module, persistence_threshold)
        self._broadcast_from_first_rank(module)
        plan: GroupingPlan = (
            module_units(module, persistence_threshold) if self.spec.shard_params
            else bucket_units(module, bucket_numel)
        )
        self.units = [
            ZeroUnit(u.name, u.params, group, shard_params=u.shard_params, comm_dtype=comm_dtype)
            for u in plan.units
        ]
        self.master_of = {
            id(p): m for unit in self.units for p, m in zip(unit.params, unit.masters)
        }
        self.tracker = ReadinessTracker([u.params for u in self.units], self._reduce_unit)
        self.unit_of = {id(p): unit for unit in self.units for p in unit.params}
        registry.register(module.parameters(), self)
        self.boundary = True
        self._pending: list = []  # (unit, finish) of reduce-scatters in flight
        # called with each unit whose reduced gradient has landed at the accumulation
        # boundary, while backward goes on (offload copies it to host memory right away)
        self.grad_shard_ready = None
        self.fetcher = None
        self.root_index: int | None = None
        if self.spec.shard_params:
            self.fetcher = Fetcher(self.units, prefetch_numel, max_live_numel)
            self._install_module_hooks(plan)

    def _gather_built_under_init(self, module: nn.Module, persistence_threshold: int) -> None:
        """Parameters built by zero.Init that this stage keeps whole are gathered once."""
        for p in module.parameters():
            keep_whole = not self.spec.shard_params or p.numel() <= persistence_threshold
            if is_partitioned(p) and keep_whole:
                gather_partitioned(p, self.group)

    def _broadcast_from_first_rank(self, module: nn.Module) -> None:
        """Every replica starts from rank 0's values (zero.Init slices are already agreed)."""
        for p in module.parameters():
            if not is_partitioned(p):
                comm.broadcast(p.data, src=0, group=self.group)

    # -- stage 3 module hooks -------------------------------------------------------------
    def _install_module_hooks(self, plan: GroupingPlan) -> None:
        # the root's hooks bracket every pass (and record the unit order for prefetch) even
        # when the root owns no sharded parameter of its own
        self.module.register_forward_pre_hook(self._root_pre_forward)
        self.module.register_forward_hook(self._root_post_forward)
        for index, (unit_plan, unit) in enumerate(zip(plan.units, self.units)):
            if not unit.shard_params:
                continue
            if unit_plan.module is self.module:  # root: whole for the entire forward+backward
                self.root_index = index
            else:
                unit_plan.module.register_forward_pre_hook(partial(self._pre_forward, index))
                unit_plan.module.register_forward_hook(partial(self._post_forward, index))

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
        return output

    def _pre_forward(self, index, module, args):
        self.fetcher.fetch(index, Pass.FORWARD)

    def _post_forward(self, index, module, args, output):
        training = torch.is_grad_enabled()
        if not (training and self.fetcher.last_in_forward(index)):
            self.fetcher.release(index)
        # else: the last block of forward is the first of backward; keeping it whole saves
        # releasing and re-gathering it back to back (one block's all-gather per step)
        if training:
            return attach_pre_backward(output, partial(self.fetcher.fetch, index, Pass.BACKWARD))
        return output  # (inference: every unit was released above)

    # -- backward -------------------------------------------------------------------------
    def begin_micro_step(self, boundary: bool) -> None:
        self.boundary = boundary
        # stage 1 reduces once per step, from full gradients accumulated over micro-steps;
        # stages 2-3 reduce every micro-step and keep only the owned, accumulated slice
        self.tracker.arm(self.spec.reduce_every_micro_step)

    def _reduce_unit(self, index: int) -> None:
        """The unit's gradients are complete: launch their reduce-scatter, which runs in
        the background while backward continues, and free the full gradients (and, under
        stage 3, the full parameters) right away."""
        unit = self.units[index]
        self._pending.append((unit, unit.launch_reduce_scatter([p.grad for p in unit.params])))
        for p in unit.params:
            p.grad = None
        if unit.shard_params and index != self.root_index:
            unit.release()
        while len(self._pending) > 1:  # keep one reduction in flight, settle the older ones
            self._settle_one()

    def _settle_one(self) -> None:
        unit, finish = self._pending.pop(0)
        unit.accumulate_grad_shard(finish())
        if self.grad_shard_ready is not None and self.boundary:
            self.grad_shard_ready(unit)

    def _settle_reductions(self) -> None:
        while self._pending:
            self._settle_one()

    def finish_backward(self) -> None:
        self.tracker.flush()
        self._settle_reductions()
        if self.fetcher is not None:
            self.fetcher.finish(Pass.BACKWARD)
            self.fetcher.release_all()
        if not self.spec.reduce_every_micro_step and self.boundary:
            for index in range(len(self.units)):
                self._reduce_unit(index)
            self._settle_reductions()

    # -- step -----------------------------------------------------------------------------
    def prepare_step(self) -> list[nn.Parameter]:
        for unit in self.units:
            unit.attach_master_grads()
        return self.masters()

    def masters(self) -> list[nn.Parameter]:
        return [m for unit in self.units for m in unit.masters]

    def grads_are_sharded(self) -> bool:
        return True

    def finish_step(self) -> None:
        for unit in self.units:
            unit.publish_masters()
            unit.drop_grads()

    # -- checkpoint contract ----------------------------------------------------------------
    def owned_slices(self) -> list[OwnedSlice]:
        out = []
        for unit in self.units:
            for name, lay, p, m in zip(unit.names, unit.layout.params, unit.params, unit.masters):
                start = unit.rank * lay.chunk
                out.append(OwnedSlice(name, lay.shape, unit.dtype, min(start, lay.numel),
                                      min(start, lay.numel) + m.numel(), m, m, True, p.requires_grad))
        return out

    def sync_params_from_masters(self) -> None:
        """Masters were overwritten (checkpoint load): rebuild parameters from them."""
        for unit in self.units:
            unit.publish_masters()

    # -- GatheredParameters ----------------------------------------------------------------
    def gather_for_user(self, params: list[nn.Parameter]) -> list[ZeroUnit]:
        """Make the units holding `params` whole; returns the ones this call gathered."""
        gathered = []
        for unit in {id(self.unit_of[id(p)]): self.unit_of[id(p)] for p in params}.values():
            if unit.shard_params and unit.state is ParamState.SHARDED:
                unit.gather()
                gathered.append(unit)
        return gathered

    def publish_user_changes(self, params: list[nn.Parameter], src_rank: int) -> None:
        units = {id(self.unit_of[id(p)]): self.unit_of[id(p)] for p in params}.values()
        for p in params:
            comm.broadcast(p.data, src=src_rank, group=self.group)
        for unit in units:
            unit.refresh_from_params()

    def release_for_user(self, gathered: list[ZeroUnit]) -> None:
        for unit in gathered:
            unit.release()

    # -- accounting -----------------------------------------------------------------------
    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        params, gathered = [], []
        for unit in self.units:
            if unit.shard_params:
                params.append(unit.shard)
                gathered.extend(unit.params)
            else:
                params.extend(unit.params)
        return {
            "params": params,
            "gathered_params": gathered,
            # fp32 training: masters alias the params (or the stage-3 shard), nothing extra
            "master_params": [u.master_buffer for u in self.units if u.master_buffer is not None],
            "grads": [u.grad_shard for u in self.units if u.grad_shard is not None]
            + [p.grad for u in self.units for p in u.params if p.grad is not None],
            "comm_buffers": [b for u in self.units for b in u.comm_buffers()],
        }

    def peak_gathered_bytes(self) -> int:
        return 0 if self.fetcher is None else self.fetcher.peak_gathered_bytes
