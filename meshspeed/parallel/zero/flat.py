"""One unit of ZeRO communication: parameters that live in one flat buffer.

Note [flat units]
A unit's parameters are views into one flat buffer, padded to a multiple of the shard
group size N, and rank r owns the contiguous range [r*S, (r+1)*S) of it (S = padded / N;
a rank's range may cover part of a parameter, several parameters, or none of a small
one). Every collective of ZeRO then runs on the buffers themselves, with no copy into or
out of a communication matrix:

    reduce-scatter(full gradients of the unit)  -> this rank's S gradient elements
    all-gather(this rank's S elements -> flat)  -> every rank's (updated) parameters

Stages 1 and 2 keep the flat buffer resident (the parameters are whole) and all-gather
in place after the step. Stage 3 (`shard_params`) keeps only the S-element shard; the
flat buffer's storage is freed on `release` and refilled by the all-gather on `gather`.

What is held of the gradients is what the stage table says:
- stage 1 keeps a flat gradient buffer for the whole unit; each `.grad` is a view of it, so
  micro-steps accumulate in place, and it is reduce-scattered from there at the boundary;
- stages 2 and 3 keep none: as backward finishes a parameter's gradient, it is copied into
  a staging buffer from a pool and freed; the staging buffer is reduce-scattered when the
  unit is complete and goes back to the pool once the reduction lands (Note [staging pool]).

Note [freeing storage, not swapping tensors]
A released stage-3 parameter keeps its identity and points at an empty placeholder (numel
0, as in DeepSpeed: touching it is an ordinary size error, never a read of freed memory).
The views it had into the flat buffer are kept; the buffer's storage is resized to zero
bytes, and `gather` resizes the same storage back and all-gathers into it (on the CPU,
Note [a fixed mmap threshold for CPU training] in meshspeed/process/malloc.py keeps
these unit-sized blocks from piling up in glibc's heap). Autograd may
have saved views of a parameter in forward (`weight.t()` inside linear); they share that
storage, so they see the re-gathered values in backward and keep nothing alive between.

Lifecycles are explicit (`ParamState`) and every transition checks where it starts from:
gathering a whole unit, releasing a sharded one or one whose module is running, and a
second reduce-scatter in one backward raise `LifecycleError`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from meshspeed import comm
from meshspeed.parallel.buckets import GradViews
from meshspeed.parallel.zero.groups import UnitGroups
from meshspeed.parallel.zero.hpz import SecondaryPartition
from meshspeed.parallel.zero.init_shards import full_shape, gather_partitioned, is_partitioned
from meshspeed.parallel.zero.lifecycle import LifecycleError, ParamState, Span
from meshspeed.parallel.zero.qgz import GradientExchange
from meshspeed.parallel.zero.qwz import BlockQuantizer
from meshspeed.parallel.zero.staging import StagingPool


@dataclass(frozen=True)
class FlatLayout:
    """Offsets of a unit's parameters in its flat buffer and each rank's owned range."""

    numels: tuple[int, ...]
    world: int

    @property
    def offsets(self) -> tuple[int, ...]:
        out, total = [], 0
        for n in self.numels:
            out.append(total)
            total += n
        return tuple(out)

    @property
    def numel(self) -> int:
        return sum(self.numels)

    @property
    def shard_numel(self) -> int:
        return max(1, -(-self.numel // self.world))  # ceil; >= 1 so every rank sends something

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.world

    def spans(self, rank: int) -> list[Span]:
        """For each parameter, the part of it that `rank` owns (possibly empty)."""
        lo, hi = rank * self.shard_numel, (rank + 1) * self.shard_numel
        out = []
        for off, n in zip(self.offsets, self.numels):
            start, end = max(off, lo), min(off + n, hi)
            if end <= start:  # owned by other ranks: an empty span where it would sit
                where = 0 if off >= hi else n
                out.append(Span(where, 0, min(max(off - lo, 0), self.shard_numel)))
            else:
                out.append(Span(start - off, end - start, start - lo))
        return out


class FlatUnit:
    """The parameters of one unit, this rank's range of them, and the unit's collectives.

    `masters[i]` is the fp32 tensor the optimizer steps on for `params[i]` (`spans[i]` of
    it): a view of the rank's own range (fp32 training, nothing duplicated) or of a
    separate fp32 `master_buffer` (bf16/fp16 training, or placed elsewhere by offload).
    `grad_shard` is the reduced gradient of the rank's range, in the parameters' dtype.
    `weight_block`: stage 3 gathers for training move INT8 weights with one fp32 scale per
    this many elements (ZeRO++ qwZ, qwz.py); gathers for the user stay exact.
    `grad_block`: stages 2-3 reduce gradients by an all-to-all of INT4 shards with one fp32
    scale per this many elements instead of a reduce-scatter (ZeRO++ qgZ, qgz.py).
    `groups.secondary`: stage 3 keeps a second copy partitioned over that (node) group and
    gathers from it until the shard changes (ZeRO++ hpZ, hpz.py)."""

    def __init__(self, name: str, params: list[tuple[str, nn.Parameter]], groups: UnitGroups, *,
                 shard_params: bool, keep_full_grads: bool, pool: StagingPool,
                 comm_dtype: torch.dtype = torch.float32, weight_block: int | None = None,
                 grad_block: int | None = None):
        self.name = name
        self.names = [n for n, _ in params]
        self.params = [p for _, p in params]
        self.shapes = [tuple(full_shape(p)) for p in self.params]  # (zero.Init's are placeholders)
        self.groups = groups
        self.world = comm.get_world_size(groups.shard)
        self.rank = comm.get_rank(groups.shard)
        self.layout = FlatLayout(tuple(torch.Size(s).numel() for s in self.shapes), self.world)
        self.shard_numel = self.layout.shard_numel
        self.spans = self.layout.spans(self.rank)
        self.shard_params = shard_params
        self.comm_dtype = comm_dtype
        self.pool = pool
        kinds = {(p.dtype, p.device) for p in self.params}
        if len(kinds) > 1:
            raise ValueError(f"unit {name}: parameters of several dtypes/devices {sorted(map(str, kinds))}; "
                             "cast the model to one dtype and device before initialize")
        self.dtype, self.device = next(iter(kinds))
        # Where a stage-3 shard lives between uses when not in `self.shard` (host memory or
        # a swap file), set by the offload placement through `use_store`: fetch(unit) ->
        # shard on the device, done(unit) after the all-gather, write(unit, values).
        self.shard_store = None
        # Freed flat buffers for the next gather (Note [gathered buffers without fresh pages]
        # in flat_cache.py), shared by the strategy's units; None: resize as allocation
        self.flat_cache = None
        # Where the fp32 masters go when they live in files (offload, Note [masters on NVMe]
        # in meshspeed/offload/masters.py): then `master_buffer` is None and
        # `master_sink(values)` receives the owned range after a change from outside.
        self.master_sink = None
        self.flat = torch.empty(self.layout.padded_numel, dtype=self.dtype, device=self.device)
        self.views = [self.flat[o : o + n].view(shape)
                      for o, n, shape in zip(self.layout.offsets, self.layout.numels, self.shapes)]
        lo = self.rank * self.shard_numel
        if shard_params:
            self.shard = self._build_shard()
        else:
            self.flat.zero_()
            for view, p in zip(self.views, self.params):
                view.copy_(p.detach())
                p.data = view
            self.shard = self.flat[lo : lo + self.shard_numel]  # a view: in place all-gather
        self.master_buffer = None if self.dtype == torch.float32 else self.shard.float()
        source = self.shard if self.master_buffer is None else self.master_buffer
        self.masters = [nn.Parameter(source[s.offset : s.offset + s.numel], requires_grad=p.requires_grad)
                        for s, p in zip(self.spans, self.params)]
        # stage 1: gradients accumulate in place in one flat buffer (views as .grad)
        self.grads = GradViews(self.params, self.layout.offsets, self.layout.padded_numel) \
            if keep_full_grads else None
        if self.grads is not None:
            self.grads.bind()
        self.grad_shard: torch.Tensor | None = None  # this step's reduced gradient (or None)
        # its storage, kept across steps (reduction outputs allocated per micro-step would
        # churn shard-sized blocks through the allocator every step) unless a placement
        # takes the gradient elsewhere (`grad_moved`); stage 1 reduces in place into its
        # own range of the full gradient buffer
        self._grad_shard_buf = self.grads.flat[lo : lo + self.shard_numel] if self.grads is not None \
            else torch.empty(self.shard_numel, dtype=self.dtype, device=self.device)
        self.state = ParamState.WHOLE
        self.in_use = 0  # forwards of the unit's module running now (stage-3 hooks count them)
        self._pending = None  # the work handle of an in-flight all-gather
        # qwZ: every rank's encoded shard, arriving (the all-gather's output until `gather`)
        self.quantizer = BlockQuantizer(self.shard_numel, weight_block) \
            if shard_params and weight_block is not None else None
        self._payloads: torch.Tensor | None = None
        self.secondary = SecondaryPartition(self.layout.padded_numel, groups.secondary, self.dtype, self.device) \
            if shard_params and groups.secondary is not None else None
        self._from_store = False  # the gather in flight read the shard from `shard_store`
        # before_gather(unit, block) -> bool: called before the unit's shard is read for a
        # gather, which the offloaded optimizer may still be writing (Note [the update that
        # runs into the next forward]); it waits when `block`, else says whether it would
        self.before_gather = None
        self._from_secondary = False  # ... or is hpZ's, inside the node group
        if grad_block is not None and keep_full_grads:
            raise ValueError(f"unit {name}: quantized gradient exchange (qgZ) needs stage 2 or 3")
        self.grad_exchange = GradientExchange(self.shard_numel, self.world, grad_block, groups.nodes) \
            if grad_block is not None else None
        self._staging: torch.Tensor | None = None  # full gradients being collected
        self._arrived = [False] * len(self.params)
        self._reducing = False
        if shard_params:
            self._placeholder = torch.empty(0, dtype=self.dtype, device=self.device)
            self._drop_full()

    def _build_shard(self) -> torch.Tensor:
        """This rank's range, read from the whole parameters (one at a time for those built
        by zero.Init, which are made whole for the copy and dropped right after)."""
        shard = torch.zeros(self.shard_numel, dtype=self.dtype, device=self.device)
        for s, p in zip(self.spans, self.params):
            if is_partitioned(p):
                gather_partitioned(p)  # a collective, in unit order
            shard[s.offset : s.offset + s.numel].copy_(p.detach().reshape(-1)[s.start : s.start + s.numel])
            p.data = torch.empty(0, dtype=self.dtype, device=self.device)
        return shard

    def use_store(self, store) -> None:
        self.shard_store = store

    def broadcast_from(self, src: int) -> None:
        """Stages 1-2: every replica starts from `src`'s values (one collective)."""
        comm.broadcast(self.flat, src=src, group=self.groups.shard)
        if self.groups.replicate is not None:
            comm.broadcast(self.flat, src=src, group=self.groups.replicate)
        if self.master_buffer is not None:
            self.master_buffer.copy_(self.shard)

    # -- stage 3 lifecycle -----------------------------------------------------------------
    def gather(self, exact: bool = False) -> None:
        """Materialise the full parameters from every rank's shard. `exact`: the shards'
        own values even under qwZ (a user's GatheredParameters, as in DeepSpeed); a
        quantized prefetch already in flight is then dropped and gathered again."""
        if self.state is ParamState.WHOLE:
            raise LifecycleError(f"unit {self.name}: gathered twice (it is already whole)")
        quantized = self._payloads is not None or (self._from_secondary and self.quantizer is not None)
        if self.state is ParamState.GATHERING and exact and quantized:
            self._land()
            self.state = ParamState.SHARDED
        if self.state is ParamState.SHARDED:
            self.gather_async(exact=exact)
        payloads, primary = self._payloads, not self._from_secondary
        self._land()
        if payloads is not None:
            self.quantizer.decode_gathered(self.flat, payloads)
        # Note [what the secondary copy holds] in hpz.py: the working weights of training
        if primary and self.secondary is not None and (self.quantizer is None or not exact):
            self.secondary.fill(self.flat)
        for p, view in zip(self.params, self.views):
            p.data = view
        self.state = ParamState.WHOLE

    def ready_to_gather(self) -> bool:
        """Whether a gather would start now, without waiting for the shard's writer."""
        return self.before_gather is None or self.before_gather(self, False)

    def gather_async(self, exact: bool = False) -> None:
        """Launch the all-gather (prefetch); `gather()` waits for it and exposes the views.
        Under qwZ (unless `exact`) it gathers every rank's encoded shard, one uint8
        payload each, which `gather()` decodes into the flat buffer."""
        if self.state is not ParamState.SHARDED:
            raise LifecycleError(f"unit {self.name}: prefetched while {self.state.value}")
        if self.before_gather is not None:
            self.before_gather(self, True)  # (before the buffer is taken: it may wait)
        nbytes = self.layout.padded_numel * self.flat.element_size()
        if self.flat_cache is None:
            self.flat.untyped_storage().resize_(nbytes)
        else:
            self.flat_cache.fill(self.flat.untyped_storage(), nbytes)
        self.state = ParamState.GATHERING
        self._from_secondary = self.secondary is not None and self.secondary.fresh and \
            (self.quantizer is None or not exact)  # an exact gather under qwZ reads the shards
        if self._from_secondary:  # hpZ: inside the node group
            self._pending = self.secondary.gather_into(self.flat)
            return
        self._from_store = self.shard_store is not None
        if self.shard_store is None:
            shard = self.shard
        else:  # a store may read the shard into our own range (then the gather is in place)
            lo = self.rank * self.shard_numel
            shard = self.shard_store.fetch(self, into=self.flat[lo : lo + self.shard_numel])
        if self.quantizer is None or exact:
            self._pending = comm.all_gather_into_tensor(self.flat, shard, group=self.groups.shard,
                                                        async_op=True)
        else:
            payload = self.quantizer.encode(shard)
            self._payloads = payload.new_empty(self.world * payload.numel())
            self._pending = comm.all_gather_into_tensor(self._payloads, payload, group=self.groups.shard,
                                                        async_op=True)

    def _land(self) -> None:
        """Wait for the all-gather in flight; the shard (and any payloads) are free again."""
        self._pending.wait()
        self._pending = None
        self._payloads = None
        if self._from_store:
            self._from_store = False
            self.shard_store.done(self)

    def release(self, for_user: bool = False) -> None:
        """Drop the full parameters, keeping only this rank's shard.

        `for_user`: the end of a user's GatheredParameters block. Tensors taken inside it
        may alias the full parameters (on CPU `p.data.cpu()` is the same storage, as
        DeepSpeed-Chat's save helper does), so the unit moves to fresh storage and leaves
        the old one to whoever still holds it, instead of freeing it under them; it is
        freed as usual when nobody does."""
        if not self.shard_params:
            raise LifecycleError(f"unit {self.name}: parameters of stages 1-2 are never released")
        if self.state is ParamState.SHARDED:
            raise LifecycleError(f"unit {self.name}: released twice (it is already sharded)")
        if self.in_use:
            raise LifecycleError(f"unit {self.name}: released while its module's forward is running")
        if self.state is ParamState.GATHERING:  # prefetched but not used: let it land first
            self._land()
        if for_user:
            self._new_flat()
        self._drop_full()

    def _new_flat(self) -> None:
        """Point the unit at a new (empty) flat buffer and new views of it."""
        # allocated, never touched (no resident pages), then emptied: views need the size
        self.flat = torch.empty(self.layout.padded_numel, dtype=self.dtype, device=self.device)
        self.views = [self.flat[o : o + n].view(shape)
                      for o, n, shape in zip(self.layout.offsets, self.layout.numels, self.shapes)]
        self.flat.untyped_storage().resize_(0)

    def _drop_full(self) -> None:
        if self.flat_cache is None:
            self.flat.untyped_storage().resize_(0)
        else:
            self.flat_cache.empty(self.flat.untyped_storage())
        for p in self.params:
            p.data = self._placeholder
        self.state = ParamState.SHARDED

    def gathered_bytes(self) -> int:
        """Bytes of full parameters resident or arriving (stage 3)."""
        return self.flat.untyped_storage().nbytes() if self.shard_params else 0

    def gathered_tensors(self) -> list[torch.Tensor]:
        return [self.flat] if self.shard_params and self.state is not ParamState.SHARDED else []

    def comm_tensors(self) -> list[torch.Tensor]:
        """qwZ payloads of an all-gather in flight."""
        return [] if self._payloads is None else [self._payloads]

    # -- gradients --------------------------------------------------------------------------
    def receive_grad(self, i: int) -> None:
        """Stages 2-3: parameter i's gradient is final for this backward; stage it, free it."""
        p = self.params[i]
        if p.grad is None:
            return
        if self._staging is None:
            self._staging = self.pool.take(self.layout.padded_numel)
            self._arrived = [False] * len(self.params)
        off = self.layout.offsets[i]
        # the layout's size: a released stage-3 parameter is a 0-element placeholder while
        # its gradient (held over a pipelined batch) is whole
        dst = self._staging[off : off + self.layout.numels[i]]
        if self._arrived[i]:  # a second gradient for the same parameter in one backward
            dst.add_(p.grad.detach().reshape(-1))
        else:
            dst.copy_(p.grad.detach().reshape(-1))
            self._arrived[i] = True
        p.grad = None

    def launch_reduce_scatter(self):
        """Start reducing this unit's full gradients; returns a callable that waits and
        yields this rank's shard of them, averaged over the shard (and replicate) group.

        The reduction runs in `comm_dtype` (fp32 unless configured otherwise); the result
        is kept in the parameters' dtype (2 bytes per owned element in bf16, as in the
        paper's accounting). Parameters without a gradient contribute zeros."""
        if self._reducing:
            raise LifecycleError(f"unit {self.name}: reduce-scatter launched twice in one backward")
        self._reducing = True
        staged = None
        if self.grads is not None:  # stage 1: the flat gradient buffer itself
            self.grads.collect()
            src = self.grads.flat
            if src.dtype != self.comm_dtype:
                src = staged = self.pool.take(src.numel()).copy_(src)
        else:
            for i, p in enumerate(self.params):  # gradients no hook has staged (flush)
                if p.grad is not None:
                    self.receive_grad(i)
            staged, self._staging = self._staging, None
            if staged is None:  # no parameter of the unit had a gradient: zeros
                staged = self.pool.take(self.layout.padded_numel).zero_()
            else:
                self._zero_gaps(staged)
            src = staged
        if self.grad_exchange is not None:
            return self._launch_quantized(staged)
        direct = self.grad_shard is None and self.comm_dtype == self.dtype
        out = self._grad_buffer() if direct else self.pool.take(self.shard_numel)
        work = comm.reduce_scatter_tensor(out, src, group=self.groups.shard, async_op=True)

        def finish() -> None:
            """Wait; this rank's averaged shard is added to `grad_shard`."""
            work.wait()
            if staged is not None:
                self.pool.give_back(staged)
            self._settle(out, direct)
            if not direct:
                self.pool.give_back(out)

        return finish

    def _settle(self, out: torch.Tensor, direct: bool = False) -> None:
        """This rank's reduced shard `out`: summed over the replicas, averaged, and added to
        `grad_shard` (`direct`: `out` is the gradient buffer itself and becomes it)."""
        if self.groups.replicate is not None:
            comm.all_reduce(out, group=self.groups.replicate)
        self._reducing = False
        if self.groups.divisor != 1:  # (x / 1 is x: one pass over the shard less at world 1)
            out.div_(self.groups.divisor)
        if direct:
            self.grad_shard = out
        elif self.grad_shard is None:
            self.grad_shard = self._grad_buffer().copy_(out)
        else:
            self.grad_shard.add_(out)

    def _launch_quantized(self, staged: torch.Tensor):
        """qgZ (qgz.py): the reduce-scatter of `launch_reduce_scatter` as INT4 all-to-alls
        (one, or two hops across nodes); the pieces of this rank's shard are summed in fp32,
        then averaged and accumulated into `grad_shard` as on the plain path."""
        pending = self.grad_exchange.launch(staged, self.groups.shard)
        self.pool.give_back(staged)  # encoded: the payloads hold what is sent

        def finish() -> None:
            self._settle(pending.result())

        return finish

    def _grad_buffer(self) -> torch.Tensor:
        if self._grad_shard_buf is None:  # dropped by `grad_moved` after the last step
            self._grad_shard_buf = torch.empty(self.shard_numel, dtype=self.dtype, device=self.device)
        return self._grad_shard_buf

    def grad_moved(self, copy: torch.Tensor) -> None:
        """The step's reduced gradient now lives in `copy` (a placement's fp32 host copy of
        the same values): it becomes `grad_shard`, and the 16-bit buffer is freed until the
        next reduction (stages 2-3; stage 1's is a view of the full gradient buffer)."""
        if copy.numel() != self.shard_numel:
            raise ValueError(f"unit {self.name}: gradient copy of {copy.numel()} elements, "
                             f"shard has {self.shard_numel}")
        self.grad_shard = copy
        if self.grads is None:
            self._grad_shard_buf = None

    def grad_written(self) -> None:
        """The step's reduced gradient went to a file (Note [gradients in their NVMe slot] in
        meshspeed/offload/grad_files.py): nothing of it stays in memory until the next reduction."""
        self.grad_shard = None
        if self.grads is None:
            self._grad_shard_buf = None

    def _zero_gaps(self, staged: torch.Tensor) -> None:
        for off, n, arrived in zip(self.layout.offsets, self.layout.numels, self._arrived):
            if not arrived:
                staged[off : off + n].zero_()
        staged[self.layout.numel :].zero_()

    def attach_master_grads(self) -> None:
        """Point each master's .grad at its span of the reduced gradient shard (fp32)."""
        if self.grad_shard is None:
            return
        grads = self.grad_shard.float()  # a temporary only when training in bf16/fp16
        for s, m in zip(self.spans, self.masters):
            if m.requires_grad:
                m.grad = grads[s.offset : s.offset + s.numel]

    def drop_grads(self) -> None:
        self.grad_shard = None
        for m in self.masters:
            m.grad = None
        if self.grads is not None:
            self.grads.bind()

    # -- parameters -------------------------------------------------------------------------
    def publish_masters(self, wait: bool = True):
        """After the optimizer step: updated masters -> the parameters. Stages 1-2
        all-gather this rank's range in place into the flat buffer the parameters view
        (with `wait=False` the work handle is returned: the caller waits); stage 3 writes
        the shard the next gather reads (a unit still whole is released)."""
        self._shard_changed()
        if not self.shard_params:
            if self.master_buffer is not None:
                self.shard.copy_(self.master_buffer)
            work = comm.all_gather_into_tensor(self.flat, self.shard, group=self.groups.shard,
                                               async_op=not wait)
            return None if wait else work
        if self.master_buffer is not None:
            self._write_shard(self.master_buffer)
        if self.state is not ParamState.SHARDED:
            self.release()
        return None

    def refresh_from_params(self) -> None:
        """The whole parameters were changed from outside (GatheredParameters with a
        modifier): keep them views of the flat buffer, rebuild the shard and masters."""
        for view, p in zip(self.views, self.params):
            if p.data_ptr() != view.data_ptr():  # the user replaced .data
                view.copy_(p.detach())
                p.data = view
        lo = self.rank * self.shard_numel
        fresh = self.flat[lo : lo + self.shard_numel]
        if self.shard_params:
            self._write_shard(fresh)
        if self.master_buffer is not None:
            self.master_buffer.copy_(fresh)
        elif self.master_sink is not None:
            self.master_sink(fresh)

    def refresh_from_masters(self) -> None:
        """Masters were written from outside the step (`safe_set_full_fp32_param`): the
        parameters follow. Like `publish_masters`, but a stage-3 unit that is whole now
        (inside `GatheredParameters`) stays whole, with the new values."""
        self._shard_changed()
        if self.shard_params and self.state is ParamState.SHARDED:
            self.publish_masters()
            return
        if self.state is ParamState.GATHERING:
            raise LifecycleError(f"unit {self.name}: masters written while its all-gather is in flight")
        if self.master_buffer is not None:
            self._write_shard(self.master_buffer)
        if self.before_gather is not None:
            self.before_gather(self, True)
        shard = self.shard if self.shard_store is None else self.shard_store.fetch(self)
        comm.all_gather_into_tensor(self.flat, shard, group=self.groups.shard)
        if self.shard_store is not None:
            self.shard_store.done(self)

    def write_shard_range(self, offset: int, values: torch.Tensor):
        """Elements [offset, offset + n) of this rank's shard become `values` (cast); the
        step's publish when the masters live in files. Returns None, or (request, buffer)
        of a write still in flight (the caller waits before the next gather)."""
        self._shard_changed()
        if self.shard_store is None:
            self.shard[offset : offset + values.numel()].copy_(values)
            return None
        return self.shard_store.write_range(self, offset, values)

    def _shard_changed(self) -> None:
        """The parameters are about to change: hpZ's secondary copy is stale."""
        if self.secondary is not None:
            self.secondary.invalidate()

    def _write_shard(self, values: torch.Tensor) -> None:
        self._shard_changed()
        if self.shard_store is None:
            self.shard.copy_(values)
        else:
            self.shard_store.write(self, values)

    # -- accounting -------------------------------------------------------------------------
    def param_tensors(self) -> list[torch.Tensor]:
        """The resident parameter bytes: the shard (and hpZ's secondary slot), or the flat buffer."""
        if not self.shard_params:
            return [self.flat]
        return [self.shard] + ([] if self.secondary is None else [self.secondary.slot])

    def grad_tensors(self) -> list[torch.Tensor]:
        out = [] if self._grad_shard_buf is None else [self._grad_shard_buf]
        if self.grads is not None:
            out.append(self.grads.flat)
        return out + [p.grad for p in self.params if p.grad is not None]


def publish_all(units: list[FlatUnit]) -> None:
    """`publish_masters` of every unit, with the all-gathers of whole units in flight
    together (one wait per unit at the end instead of a round trip per unit)."""
    works = [unit.publish_masters(wait=False) for unit in units]
    for work in works:
        if work is not None:
            work.wait()
