"""1-bit Adam (Tang et al., arXiv:2102.02888): Adam whose momentum is averaged in 1 bit.

Note [1-bit Adam's two phases]
Warm-up, steps 1..freeze_step: the engine all-reduces the gradients in fp32 as for any
optimizer, and this is Adam: m = b1 m + (1-b1) g, v = b2 v + (1-b2) g^2.
Compressed, every later step: v is frozen (the paper's observation: after warm-up Adam's
variance changes slowly, so it can act as a fixed preconditioner), the engine leaves the
gradients local (`compressing()` tells the strategy, Note [gradients left local] in
parallel/data/ddp.py), each rank folds its own gradient into its momentum, and the momenta
are averaged by `meshspeed.comm.compressed.CompressedAllReduce`: error-compensated signs,
1 bit per element plus scales, two stages. Every rank ends with the same momentum, so
parameters stay identical.
The update in both phases is DeepSpeed's (OnebitAdam in 0.x): p -= lr * (m / (sqrt(v) + eps)
+ weight_decay * p); there is no bias correction (DeepSpeed accepts `bias_correction`
and ignores it, so do we), and weight decay is decoupled, added to the update.
A single rank has no one to talk to: momentum is then used as is (DeepSpeed too).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from meshspeed import comm
from meshspeed.comm.compressed import CompressedAllReduce

__all__ = ["COMM_BACKENDS", "OneBitAdam"]

log = logging.getLogger("meshspeed")

# DeepSpeed's comm_backend_name values; each means "the data-parallel group's backend" here
COMM_BACKENDS = ("nccl", "mpi", "hccl", "compressed")


class OneBitAdam(torch.optim.Optimizer):
    """DeepSpeed's `OnebitAdam` params over meshspeed's compressed all-reduce on `group`.

    `freeze_step`: the number of warm-up steps with full-precision gradients (DeepSpeed's
    default, 100000, is meant for long pre-training runs). `cuda_aware` and
    `comm_backend_name` choose DeepSpeed's transport; meshspeed has one, over `group`."""

    def __init__(self, params, lr: float = 1e-3, freeze_step: int = 100000,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, bias_correction: bool = True, cuda_aware: bool = False,
                 comm_backend_name: str = "nccl", group: Any = None):
        if not isinstance(freeze_step, int) or isinstance(freeze_step, bool) or freeze_step < 0:
            raise ValueError(f"optimizer.params.freeze_step: expected a whole number >= 0, got {freeze_step!r}")
        if comm_backend_name not in COMM_BACKENDS:
            raise ValueError(f"optimizer.params.comm_backend_name: {comm_backend_name!r} is not one "
                             f"of DeepSpeed's {list(COMM_BACKENDS)}")
        if comm.is_initialized() and comm.get_rank() == 0 and (cuda_aware or comm_backend_name != "nccl"):
            log.info("OneBitAdam: cuda_aware=%s, comm_backend_name=%r have no effect; the compressed "
                     "all-reduce runs over the data-parallel group's backend", cuda_aware, comm_backend_name)
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})
        self.freeze_step = freeze_step
        self.group = group
        self.world = comm.get_world_size(group) if comm.is_initialized() else 1
        self._allreduce: CompressedAllReduce | None = None  # built on the first compressed step

    # -- phases ------------------------------------------------------------------------------
    def steps_taken(self) -> int:
        """Optimizer steps applied so far (kept per parameter in `state`, so checkpoints carry it)."""
        for state in self.state.values():
            return int(state["step"])
        return 0

    def compressing(self) -> bool:
        """Whether the coming step is a compressed one: its gradients must stay local."""
        return self.steps_taken() >= self.freeze_step

    # -- the step ----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        compressed = self.compressing()
        live = []  # (param, state, group) of the parameters with a gradient this step
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse or p.dtype != torch.float32:
                    raise TypeError("OneBitAdam steps on dense fp32 tensors only "
                                    f"(got {p.dtype}{', sparse' if p.grad.is_sparse else ''})")
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                state["exp_avg"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
                if not compressed:  # Note [1-bit Adam's two phases]: v frozen afterwards
                    state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                live.append((p, state, group))
        if compressed and self.world > 1 and live:
            self._average_momentum([state["exp_avg"] for _, state, _ in live])
        for p, state, group in live:
            update = state["exp_avg"] / (state["exp_avg_sq"].sqrt() + group["eps"])
            if group["weight_decay"] > 0:
                update.add_(p, alpha=group["weight_decay"])
            p.add_(update, alpha=-group["lr"])
        return loss

    def _average_momentum(self, momenta: list[torch.Tensor]) -> None:
        flat = torch.cat([m.reshape(-1) for m in momenta])
        if self._allreduce is None or self._allreduce.numel != flat.numel():
            if self._allreduce is not None:
                raise RuntimeError("OneBitAdam: the set of parameters with gradients changed after "
                                   "freeze_step; the error-feedback buffers no longer line up")
            self._allreduce = CompressedAllReduce(flat.numel(), self.group, flat.device)
        self._allreduce(flat)
        offset = 0
        for m in momenta:
            m.copy_(flat[offset: offset + m.numel()].view_as(m))
            offset += m.numel()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load moments and step counts; the compression errors restart from zero
        (they are not saved, as in DeepSpeed)."""
        super().load_state_dict(state_dict)
        if self._allreduce is not None:
            self._allreduce.reset()
