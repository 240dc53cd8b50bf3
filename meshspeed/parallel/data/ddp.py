"""Data parallelism (ZeRO stage 0): replicated parameters, gradients averaged by all-reduce.

Gradients live in flat buckets of at most `bucket_numel` elements; each parameter's `.grad`
is a view into its bucket, so autograd accumulates micro-steps in place and a bucket is
all-reduced, as one collective, from the gradient hook of its last parameter at the
accumulation boundary (overlapping the rest of backward when `overlap_comm`). No
collective runs on the micro-steps in between.
"""

from __future__ import annotations

import torch
from torch import nn

from meshspeed import comm
from meshspeed.parallel import registry
from meshspeed.parallel.buckets import GradViews, split_by_numel, trainable
from meshspeed.parallel.readiness import ReadinessTracker
from meshspeed.parallel.slices import OwnedSlice, ParamAccess
from meshspeed.parallel.weak import weak_method


class _Bucket(GradViews):
    """Gradients of consecutive parameters in one flat buffer, all-reduced as one."""

    def __init__(self, params: list[nn.Parameter], comm_dtype: torch.dtype):
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


class DataParallel:
    """Stage 0. `masters` are the tensors the optimizer steps on (the params in fp32)."""

    def __init__(
        self,
        module: nn.Module,
        group,
        *,
        bucket_numel: int,
        comm_dtype: torch.dtype = torch.float32,
        overlap_comm: bool = True,
    ):
        self.module = module
        self.group = group
        self.world = comm.get_world_size(group)
        self.overlap = overlap_comm
        params = [p for p in module.parameters()]
        self.params = params
        # frozen parameters need no reduction; reverse order ~ the order backward produces grads
        self.buckets = [
            _Bucket(ps, comm_dtype) for ps in split_by_numel(reversed(trainable(params)), bucket_numel)
        ]
        for b in self.buckets:
            b.bind()
        self.mixed = any(p.dtype != torch.float32 for p in params)
        self.master_of = {
            id(p): (nn.Parameter(p.detach().float().clone(), requires_grad=p.requires_grad) if self.mixed else p)
            for p in params
        }
        self.bucket_of = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        self._launched = False  # this step's reductions were started
        self._averaged = False  # ... and have landed and been averaged
        self.tracker = ReadinessTracker([b.params for b in self.buckets], weak_method(self._launch))
        self._sync_params()
        registry.register(params, self)

    def _sync_params(self) -> None:
        """Start from rank 0's weights so every replica is identical."""
        for p in self.params:
            comm.broadcast(p.data, src=0, group=self.group)
        for p in self.params:
            if self.mixed:
                self.master_of[id(p)].data.copy_(p.data)

    # -- backward -------------------------------------------------------------------------
    def begin_micro_step(self, boundary: bool) -> None:
        self.tracker.arm(boundary)

    def hold_reductions(self) -> None:
        self.tracker.arm(False)  # gradients accumulate in .grad; the next boundary reduces them

    def _launch(self, index: int) -> None:
        bucket = self.buckets[index]
        bucket.collect()
        buf = bucket.flat if bucket.reduced is None else bucket.reduced.copy_(bucket.flat)
        bucket.work = comm.all_reduce(buf, group=self.group, async_op=self.overlap)
        self._launched = True

    def finish_backward(self) -> None:
        self.tracker.flush()

    # -- step -----------------------------------------------------------------------------
    def _average(self) -> None:
        """Wait for this step's reductions and average them (once per step)."""
        if self._averaged:
            return
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
                bucket.work = None
            self._reduced(bucket).div_(self.world)
        self._averaged = True

    @staticmethod
    def _reduced(bucket: _Bucket) -> torch.Tensor:
        return bucket.flat if bucket.reduced is None else bucket.reduced

    def prepare_step(self) -> list[nn.Parameter]:
        """Wait for reductions, average, and expose gradients on the master tensors."""
        self._average()
        for bucket in self.buckets:
            reduced = self._reduced(bucket)
            for i, p in enumerate(bucket.params):
                if self.mixed:
                    self.master_of[id(p)].grad = bucket.view(reduced, i).float()
        return self.masters()

    def masters(self) -> list[nn.Parameter]:
        return [self.master_of[id(p)] for p in self.params]

    def grad_norm_groups(self) -> list:
        return []  # every rank holds every (reduced) gradient: norms need no collective

    def deferred_grads(self) -> None:
        return None  # the masters carry their gradients

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
        self._launched = self._averaged = False

    # -- user access (meshspeed/parallel/access.py) -------------------------------------------
    def param_access(self, param: nn.Parameter) -> ParamAccess:
        """Every rank holds the whole parameter; its gradient is known once this step's
        reductions were started (the backward of the boundary micro-step)."""
        master = self.master_of[id(param)]
        grad = None
        if self._launched and id(param) in self.bucket_of:
            self._average()
            bucket, i = self.bucket_of[id(param)]
            grad = bucket.view(self._reduced(bucket), i).reshape(-1)
        publish = (lambda: param.data.copy_(master.detach())) if self.mixed else (lambda: None)
        return ParamAccess(param.shape, 0, param.numel(), master.detach().view(-1), master, grad, False,
                           self.group, publish)

    # -- checkpoint contract ----------------------------------------------------------------
    def owned_slices(self) -> list[OwnedSlice]:
        writer = comm.get_rank(self.group) == 0  # replicas: the first rank writes
        return [
            OwnedSlice(name, tuple(p.shape), p.dtype, 0, p.numel(), self.master_of[id(p)].view(-1),
                       self.master_of[id(p)], writer, p.requires_grad)
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
            comm.broadcast(p.data, src=src_rank, group=self.group)
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
            "comm_buffers": [b.reduced for b in self.buckets if b.reduced is not None],
        }

    def host_tensors(self) -> list[torch.Tensor]:
        return []

    def nvme_bytes(self) -> dict[str, int]:
        return {}

    def peak_gathered_bytes(self) -> int:
        return 0
