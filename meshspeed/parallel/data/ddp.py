"""Data parallelism (ZeRO stage 0): replicated parameters, gradients averaged by all-reduce.

Gradients live in flat buckets of at most `bucket_numel` elements; each parameter's `.grad`
is a view into its bucket, so autograd accumulates micro-steps in place and a bucket is
all-reduced, as one collective, from the gradient hook of its last parameter at the
accumulation boundary (overlapping the rest of backward when `overlap_comm`). No
collective runs on the micro-steps in between.

With a `GradCompression` policy (the `gradient_compression` block) a bucket is instead
compressed, with this rank's error-feedback residual added, and its payload sent from the
same hook (an all-gather, or the all-to-all of Note [two hops]); every rank decodes and
sums the payloads at the step, identically (compress.py).

Note [gradients left local]
An optimizer that communicates by itself (1-bit Adam after its warm-up, optim/onebit.py)
hands `leave_gradients_local` a predicate; while it answers True, buckets are not reduced
and `.grad` holds this rank's own (accumulated) gradient. It is asked when the boundary
reduction would start, so its answer may change from one step to the next.
On such a step the ranks hold different gradients, so the gradient norm and the
non-finite check are reduced over dp (the step's `groups`), each rank's squares weighted
1/dp (its `weights`): every rank clips by the same coefficient, the root mean square of
the local norms, and all skip a step together.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from meshspeed import comm
from meshspeed.parallel import registry
from meshspeed.parallel.buckets import GradViews, split_by_numel, trainable
from meshspeed.parallel.data.compress import (
    CompressedBucket,
    GradCompression,
    TwoHopBucket,
    compressed_bucket,
)
from meshspeed.parallel.experts import ExpertSpec
from meshspeed.parallel.protocol import LocalGradients, ParameterOwner, RankState, Strategy
from meshspeed.parallel.readiness import ReadinessTracker
from meshspeed.parallel.slices import OwnedSlice, ParamAccess
from meshspeed.parallel.step import StepGradients
from meshspeed.parallel.weak import weak_method

log = logging.getLogger("meshspeed")


class _Bucket(GradViews):
    """Gradients of consecutive parameters in one flat buffer, all-reduced as one."""

    def __init__(self, params: list[nn.Parameter], comm_dtype: torch.dtype, group):
        self.group = group  # the ranks holding the same parameters: dp, or edp for experts
        offsets, total = [], 0
        for p in params:
            offsets.append(total)
            total += p.numel()
        super().__init__(params, offsets, total)
        # gradients are reduced in comm_dtype; when it differs from the parameter dtype the
        # reduced fp32 values are kept here and become the fp32 master gradients
        dtype = self.flat.dtype
        self.reduced = None if comm_dtype == dtype else torch.zeros(total, dtype=comm_dtype, device=self.flat.device)
        self.work = None
        self.compressed: CompressedBucket | TwoHopBucket | None = None  # set when gradients are compressed


class DataParallel(Strategy, ParameterOwner, RankState, LocalGradients):
    """Stage 0. `masters` are the tensors the optimizer steps on (the params in fp32)."""

    def __init__(
        self,
        module: nn.Module,
        group,
        *,
        bucket_numel: int,
        comm_dtype: torch.dtype = torch.float32,
        overlap_comm: bool = True,
        experts: ExpertSpec | None = None,
        compression: GradCompression | None = None,
    ):
        self.module = module
        self.group = group
        self.world = comm.get_world_size(group)  # every gradient is divided by dp
        self.overlap = overlap_comm
        self.experts = experts
        params = [p for p in module.parameters()]
        self.params = params
        # frozen parameters need no reduction; reverse order ~ the order backward produces grads
        order = list(reversed(trainable(params)))
        dense = [p for p in order if not self._is_expert(p)]
        expert = [p for p in order if self._is_expert(p)]
        self.buckets = [_Bucket(ps, comm_dtype, group) for ps in split_by_numel(dense, bucket_numel)]
        if expert:
            self.buckets += [_Bucket(ps, comm_dtype, experts.group)
                             for ps in split_by_numel(expert, bucket_numel)]
        self.compression = compression
        self._steps = 0  # optimizer steps finished (compression starts after its warm-up)
        for b in self.buckets:
            b.bind()
            if compression is not None:
                b.compressed = compressed_bucket(compression, b.flat.numel(), b.flat.device, b.group)
        self.mixed = any(p.dtype != torch.float32 for p in params)
        self.master_of = {
            id(p): (nn.Parameter(p.detach().float().clone(), requires_grad=p.requires_grad) if self.mixed else p)
            for p in params
        }
        self.bucket_of = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        self._launched = False  # this step's reductions were started
        self._accumulated = False  # a backward ran since the last step
        self._averaged = False  # ... and have landed and been averaged
        self._leave_local: Callable[[], bool] | None = None  # Note [gradients left local]
        self._local = False  # this step's gradients were left local
        self.tracker = ReadinessTracker([b.params for b in self.buckets], weak_method(self._launch))
        self._sync_params()
        registry.register(params, self)

    def _is_expert(self, p: nn.Parameter) -> bool:
        return self.experts is not None and self.experts.holds(p)

    def _group_of(self, p: nn.Parameter):
        """The ranks holding replicas of `p`: dp, or edp for an expert parameter."""
        return self.experts.group if self._is_expert(p) else self.group

    def _sync_params(self) -> None:
        """Start from the first replica's weights so every replica is identical (expert
        parameters: the first of their edp group; other ep ranks hold other experts)."""
        for p in self.params:
            comm.broadcast(p.data, src=0, group=self._group_of(p))
        for p in self.params:
            if self.mixed:
                self.master_of[id(p)].data.copy_(p.data)

    # -- backward -------------------------------------------------------------------------
    def begin_micro_step(self, boundary: bool, loss_scale: float = 1.0) -> None:
        self.tracker.arm(boundary)

    def leave_gradients_local(self, when: Callable[[], bool]) -> None:
        self._leave_local = when

    def hold_reductions(self) -> None:
        self.tracker.arm(False)  # gradients accumulate in .grad; the next boundary reduces them

    def _launch(self, index: int) -> None:
        bucket = self.buckets[index]
        bucket.collect()
        if not self._launched:
            self._local = self._leave_local is not None and self._leave_local()
        self._launched = True
        if self._local:
            return  # Note [gradients left local]
        if bucket.compressed is not None and self._steps >= self.compression.warmup_steps:
            bucket.work = bucket.compressed.launch(bucket.flat, async_op=self.overlap)
            return
        buf = bucket.flat if bucket.reduced is None else bucket.reduced.copy_(bucket.flat)
        bucket.work = comm.all_reduce(buf, group=bucket.group, async_op=self.overlap)

    def finish_backward(self) -> None:
        self.tracker.flush()
        self._accumulated = True

    def drop_unreduced(self) -> None:
        if self._accumulated and not self._launched:
            for bucket in self.buckets:
                bucket.bind()
            self._accumulated = False

    # -- step -----------------------------------------------------------------------------
    def _average(self) -> None:
        """Wait for this step's reductions and average them (once per step)."""
        if self._averaged:
            return
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
                bucket.work = None
            if not self._local:
                if bucket.compressed is not None and bucket.compressed.gathered is not None:
                    bucket.compressed.sum_into(self._reduced(bucket))
                self._reduced(bucket).div_(self.world)  # dp, for experts too (Note in layer.py)
        self._averaged = True

    @staticmethod
    def _reduced(bucket: _Bucket) -> torch.Tensor:
        return bucket.flat if bucket.reduced is None else bucket.reduced

    def prepare_step(self) -> StepGradients:
        """Wait for reductions, average, and expose gradients on the master tensors."""
        self._average()
        for bucket in self.buckets:
            reduced = self._reduced(bucket)
            for i, p in enumerate(bucket.params):
                if self.mixed:
                    self.master_of[id(p)].grad = bucket.view(reduced, i).float()
        spread = self._local or self.experts is not None  # ranks hold different gradients
        return StepGradients(self.masters(), groups=[self.group] if spread else [],
                             weights=self._norm_weights if spread else None)

    def masters(self) -> list[nn.Parameter]:
        return [self.master_of[id(p)] for p in self.params]

    def _norm_weights(self, masters: list[nn.Parameter]) -> list[float]:
        """Per master, the weight of its squared norm in the sum over dp that counts each
        element once: a dense gradient is replicated over dp (1/dp), an expert gradient
        over edp only (1/edp); local gradients (Note [gradients left local]) 1/dp each.
        Without either, every rank holds every reduced gradient and the norm needs no
        collective (prepare_step gives no groups)."""
        if self._local:
            return [1.0 / self.world] * len(masters)
        expert_ids = {id(self.master_of[id(p)]) for p in self.params if self._is_expert(p)}
        edp = comm.get_world_size(self.experts.group)
        return [1.0 / edp if id(m) in expert_ids else 1.0 / self.world for m in masters]

    @property
    def shards_params(self) -> bool:
        return False

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass

    def finish_step(self) -> None:
        if self.mixed:
            for p in self.params:
                p.data.copy_(self.master_of[id(p)].data)
                self.master_of[id(p)].grad = None
        for b in self.buckets:
            b.bind()
        self._launched = self._averaged = self._local = self._accumulated = False
        self._steps += 1

    # -- rank-local state (Note [rank-local state] in checkpoint/load.py) ------------------------
    def rank_state(self) -> dict[str, torch.Tensor]:
        """This rank's error-feedback residuals of `gradient_compression`, per bucket."""
        out = {}
        for i, b in enumerate(self.buckets):
            for kind, t in zip(("residual", "shard_residual"), (b.compressed.buffers() if b.compressed else [])):
                out[f"{kind}/{i}"] = t
        return out

    def load_rank_state(self, state: dict[str, torch.Tensor], steps: int) -> None:
        """Residuals saved by this rank at the same layout, else zeros; the compression
        warm-up continues from `steps` optimizer steps."""
        self._steps = steps
        mine = self.rank_state()
        fits = set(state) == set(mine) and all(state[k].shape == t.shape for k, t in mine.items())
        for k, t in mine.items():
            if fits:
                t.copy_(state[k])
            else:
                t.zero_()
        if mine and not fits and comm.get_rank() == 0:
            log.warning("gradient_compression: the error-feedback residuals restart at zero (the "
                        "checkpoint was saved at another world size or bucket layout)")

    # -- user access (meshspeed/parallel/access.py) -------------------------------------------
    def param_access(self, param: nn.Parameter) -> ParamAccess:
        """Every rank holds the whole parameter; its gradient is the reduced one once this
        step's reductions were started (the backward of the boundary micro-step), and this
        rank's own before that (Note [local gradients before the reduction] in access.py)."""
        master = self.master_of[id(param)]
        grad, local = None, False
        if self._launched and id(param) in self.bucket_of:
            self._average()
            bucket, i = self.bucket_of[id(param)]
            grad = bucket.view(self._reduced(bucket), i).reshape(-1)
        elif self._accumulated and param.grad is not None:
            grad, local = param.grad.reshape(-1), True
        publish = (lambda: param.data.copy_(master.detach())) if self.mixed else (lambda: None)
        return ParamAccess(param.shape, 0, param.numel(), master.detach().view(-1), master, grad, False,
                           self._group_of(param), publish, local)

    # -- checkpoint contract ----------------------------------------------------------------
    def owned_slices(self) -> list[OwnedSlice]:
        # replicas: the first rank of the group holding them writes; expert parameters
        # are named by their global expert id (Note [expert parameters in the strategies])
        names = self.experts.names if self.experts is not None else {}
        return [
            OwnedSlice(names.get(id(p), name), tuple(p.shape), p.dtype, 0, p.numel(),
                       self.master_of[id(p)].view(-1), self.master_of[id(p)],
                       comm.get_rank(self._group_of(p)) == 0, p.requires_grad)
            for name, p in self.module.named_parameters()
        ]

    def sync_params_from_masters(self) -> None:
        if self.mixed:
            for p in self.params:
                p.data.copy_(self.master_of[id(p)].data)

    # -- GatheredParameters: parameters are always whole here ------------------------------
    def gather_for_user(self, params: list[nn.Parameter]) -> None:
        return None

    def publish_user_changes(self, params: list[nn.Parameter], src_rank: int) -> None:
        for p in params:
            comm.broadcast(p.data, src=src_rank, group=self._group_of(p))
            if self.mixed:
                self.master_of[id(p)].data.copy_(p.data)

    def release_for_user(self, token: None) -> None:
        pass

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        masters = [m for m in self.masters() if self.mixed]
        return {
            "params": list(self.params),
            "master_params": masters,
            "grads": [b.flat for b in self.buckets],
            "comm_buffers": [b.reduced for b in self.buckets if b.reduced is not None]
            + [t for b in self.buckets if b.compressed is not None for t in b.compressed.buffers()],
        }

    def host_tensors(self) -> list[torch.Tensor]:
        return []

    def nvme_bytes(self) -> dict[str, int]:
        return {}

    def peak_gathered_bytes(self) -> int:
        return 0
