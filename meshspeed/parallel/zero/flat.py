"""Stages 1 and 2: a unit of whole parameters that live in one flat buffer.

Note [flat units for stages 1 and 2]
Under stages 1 and 2 every rank keeps the full parameters, so there is no reason to cut
each parameter into N pieces (stage 3's layout, layout.py). Instead a unit's parameters
are views into one flat buffer, padded to a multiple of N, and rank r owns the contiguous
range [r*S, (r+1)*S) of it (S = padded / N; a rank's range may cover part of a
parameter, several parameters, or none of a small one). Then both collectives of a step
run on the buffers themselves, with no copy into or out of a communication matrix:

    reduce-scatter(full gradients of the unit) -> this rank's S gradient elements
    all-gather(flat[r*S:(r+1)*S], in place)    -> every rank's updated parameters

and no persistent communication buffer exists. What is held of the gradients is what the
stage table says:
- stage 1 keeps a flat gradient buffer for the whole unit; each `.grad` is a view of it, so
  micro-steps accumulate in place, and it is reduce-scattered from there at the boundary;
- stage 2 keeps none: as backward finishes a parameter's gradient, it is copied into a
  staging buffer taken from a small pool and freed; the staging buffer is reduce-scattered
  when the unit is complete and goes back to the pool once the reduction lands. At most a
  few units' worth of full gradients exist at any moment (Note [staging pool]).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from meshspeed import comm
from meshspeed.parallel.buckets import GradViews
from meshspeed.parallel.zero.groups import UnitGroups
from meshspeed.parallel.zero.lifecycle import LifecycleError, Span
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
    """Whole parameters of one unit as views of a flat buffer; this rank's range of it.

    The interface is the one `Zero` and the offload placement use for every unit:
    `masters[i]` (fp32, this rank's span of parameter i), `spans[i]`, `master_buffer`
    (separate fp32 masters or None), `grad_shard`, `shard_numel`, `attach_master_grads`,
    `drop_grads`, `publish_masters`, `refresh_from_params`."""

    shard_params = False

    def __init__(self, name: str, params: list[tuple[str, nn.Parameter]], groups: UnitGroups, *,
                 keep_full_grads: bool, pool: StagingPool, comm_dtype: torch.dtype = torch.float32):
        self.name = name
        self.names = [n for n, _ in params]
        self.params = [p for _, p in params]
        self.groups = groups
        self.world = comm.get_world_size(groups.shard)
        self.rank = comm.get_rank(groups.shard)
        self.layout = FlatLayout(tuple(p.numel() for p in self.params), self.world)
        self.shard_numel = self.layout.shard_numel
        self.shapes = [tuple(p.shape) for p in self.params]
        self.spans = self.layout.spans(self.rank)
        self.comm_dtype = comm_dtype
        self.pool = pool
        self.dtype = self.params[0].dtype
        self.device = self.params[0].device
        kinds = {(p.dtype, p.device) for p in self.params}
        if len(kinds) > 1:
            raise ValueError(f"unit {name}: parameters of several dtypes/devices {sorted(map(str, kinds))}; "
                             "cast the model to one dtype and device before initialize")
        self.flat = torch.zeros(self.layout.padded_numel, dtype=self.dtype, device=self.device)
        for off, p in zip(self.layout.offsets, self.params):
            self.flat[off : off + p.numel()].copy_(p.detach().reshape(-1))
            p.data = self.flat[off : off + p.numel()].view(p.shape)
        lo = self.rank * self.shard_numel
        self.own = self.flat[lo : lo + self.shard_numel]
        self.master_buffer = None if self.dtype == torch.float32 else self.own.float()
        source = self.own if self.master_buffer is None else self.master_buffer
        self.masters = [nn.Parameter(source[s.offset : s.offset + s.numel], requires_grad=p.requires_grad)
                        for s, p in zip(self.spans, self.params)]
        # stage 1: gradients accumulate in place in one flat buffer (views as .grad)
        self.grads = GradViews(self.params, self.layout.offsets, self.layout.padded_numel) \
            if keep_full_grads else None
        if self.grads is not None:
            self.grads.bind()
        self.grad_shard: torch.Tensor | None = None
        self._staging: torch.Tensor | None = None  # stage 2: full gradients being collected
        self._arrived = [False] * len(self.params)
        self._reducing = False

    def broadcast_from(self, src: int) -> None:
        """Every replica starts from `src`'s values (one collective for the unit)."""
        comm.broadcast(self.flat, src=src, group=self.groups.shard)
        if self.groups.replicate is not None:
            comm.broadcast(self.flat, src=src, group=self.groups.replicate)
        if self.master_buffer is not None:
            self.master_buffer.copy_(self.own)

    # -- gradients --------------------------------------------------------------------------
    def receive_grad(self, i: int) -> None:
        """Stage 2: parameter i's gradient is final for this backward; stage it, free it."""
        p = self.params[i]
        if p.grad is None:
            return
        if self._staging is None:
            self._staging = self.pool.take(self.layout.padded_numel)
            self._arrived = [False] * len(self.params)
        off = self.layout.offsets[i]
        dst = self._staging[off : off + p.numel()]
        if self._arrived[i]:  # a second gradient for the same parameter in one backward
            dst.add_(p.grad.detach().reshape(-1))
        else:
            dst.copy_(p.grad.detach().reshape(-1))
            self._arrived[i] = True
        p.grad = None

    def launch_reduce_scatter(self):
        """Start reducing this unit's full gradients; returns a callable that waits and
        yields this rank's shard of them, averaged over the shard (and replicate) group."""
        if self._reducing:
            raise LifecycleError(f"unit {self.name}: reduce-scatter launched twice in one backward")
        self._reducing = True
        if self.grads is not None:  # stage 1: the flat gradient buffer itself
            self.grads.collect()
            src = self.grads.flat
            staged = None
            if src.dtype != self.comm_dtype:
                staged = self.pool.take(src.numel())
                staged.copy_(src)
                src = staged
        else:
            staged = self._staging
            if staged is None:  # no parameter of the unit had a gradient: zeros
                staged = self.pool.take(self.layout.padded_numel)
                staged.zero_()
            else:
                self._zero_gaps(staged)
            src, self._staging = staged, None
        out = torch.empty(self.shard_numel, dtype=self.comm_dtype, device=self.device)
        work = comm.reduce_scatter_tensor(out, src, group=self.groups.shard, async_op=True)

        def finish() -> torch.Tensor:
            work.wait()
            if staged is not None:
                self.pool.give_back(staged)
            if self.groups.replicate is not None:
                comm.all_reduce(out, group=self.groups.replicate)
            self._reducing = False
            return out.div_(self.groups.size).to(self.dtype)

        return finish

    def _zero_gaps(self, staged: torch.Tensor) -> None:
        for off, n, arrived in zip(self.layout.offsets, self.layout.numels, self._arrived):
            if not arrived:
                staged[off : off + n].zero_()
        staged[self.layout.numel :].zero_()

    def accumulate_grad_shard(self, shard: torch.Tensor) -> None:
        if self.grad_shard is None:
            self.grad_shard = shard
        else:
            self.grad_shard.add_(shard)

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
    def publish_masters(self) -> None:
        """After the optimizer step: this rank's updated range -> every rank's parameters,
        all-gathered in place into the flat buffer the parameters view."""
        if self.master_buffer is not None:
            self.own.copy_(self.master_buffer)
        comm.all_gather_into_tensor(self.flat, self.own, group=self.groups.shard)

    def refresh_from_params(self) -> None:
        """Parameters were changed from outside (GatheredParameters with a modifier): keep
        them views of the flat buffer and rebuild the separate fp32 masters from it."""
        for off, p in zip(self.layout.offsets, self.params):
            view = self.flat[off : off + p.numel()]
            if p.data_ptr() != view.data_ptr():  # the user replaced .data
                view.copy_(p.detach().reshape(-1))
                p.data = view.view(p.shape)
        if self.master_buffer is not None:
            self.master_buffer.copy_(self.own)

    # -- accounting -------------------------------------------------------------------------
    def param_tensors(self) -> list[torch.Tensor]:
        return [self.flat]

    def grad_tensors(self) -> list[torch.Tensor]:
        out = [] if self.grad_shard is None else [self.grad_shard]
        if self.grads is not None:
            out.append(self.grads.flat)
        return out + [p.grad for p in self.params if p.grad is not None]

    def gathered_bytes(self) -> int:
        return 0
