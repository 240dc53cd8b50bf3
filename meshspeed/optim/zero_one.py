"""0/1 Adam (Lu et al., arXiv:2202.06009): 1-bit gradients, rare variance updates, local steps.

Note [0/1 Adam's schedule]
Counting steps t = 1, 2, ... from meshspeed's first (DeepSpeed also counts an
initialisation call that moves nothing):
* t <= var_freeze_step: the variance is updated only on steps where t % var_interval == 0
  ("full" steps: the engine all-reduces the gradients in fp32, m and v take them). On the
  others the engine leaves gradients local and they are averaged in 1 bit
  (`CompressedAllReduce`); only m takes them. After every var_update_scaler full steps
  var_interval doubles (1, 2, 4, ...), so full steps become exponentially rare.
* t > var_freeze_step: v is frozen and the error buffers restart from zero. Each rank
  steps alone with its own gradient ("local" steps), summing its updates in u (and the
  learning rates in lrs). On steps where t % local_step_interval == 0 ("sync"), each rank
  takes back its local updates u, the ranks average u * (sqrt(v) + eps) in 1 bit, and all
  apply the average divided by (sqrt(v) + eps) (parameters are equal again); m becomes
  -average / lrs. Every local_step_scaler steps local_step_interval doubles, up to
  local_step_clipper.
The update is 1-bit Adam's (no bias correction, decoupled weight decay: optim/onebit.py).

Note [0/1 Adam's anchor]
DeepSpeed sums the local updates in u and takes them back with p -= u; in floating point
that rollback is not exact, and each rank's rounding differs, so replicas drift apart by a
few ulps per sync. meshspeed keeps instead the parameters of the last sync (the anchor,
the same memory as u): u = p - anchor, and a sync sets p = anchor + average, bit-equal on
every rank. Between syncs the ranks' parameters differ; a checkpoint holds rank 0's, with
its anchor, so a resumed run restarts from the last sync's parameters on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from meshspeed.optim.onebit import CompressedOptimizer, whole_number

__all__ = ["ZeroOneAdam", "zero_one_plan"]


def zero_one_plan(steps: int, var_freeze_step: int, var_update_scaler: int, local_step_scaler: int,
                  local_step_clipper: int) -> list[str]:
    """What each of steps 1..steps does, "full" / "compressed" / "local" / "sync", by the
    rules of Note [0/1 Adam's schedule] (pure: for reading and for tests)."""
    plan, var_interval, var_counter, local_interval, local_counter = [], 1, 0, 1, 0
    for t in range(1, steps + 1):
        if t <= var_freeze_step:
            full = t % var_interval == 0
            plan.append("full" if full else "compressed")
            if full:
                var_counter += 1
                if var_counter == var_update_scaler:
                    var_counter, var_interval = 0, var_interval * 2
        else:
            plan.append("sync" if t % local_interval == 0 else "local")
            local_counter += 1
            if local_counter == local_step_scaler:
                local_counter, local_interval = 0, min(local_step_clipper, local_interval * 2)
    return plan


class ZeroOneAdam(CompressedOptimizer):
    """DeepSpeed's `ZeroOneAdam` params over meshspeed's compressed all-reduce on `group`."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, bias_correction: bool = True,
                 var_freeze_step: int = 100000, var_update_scaler: int = 16,
                 local_step_scaler: int = 32678, local_step_clipper: int = 16,
                 cuda_aware: bool = False, comm_backend_name: str = "nccl", group: Any = None):
        self.var_freeze_step = whole_number("var_freeze_step", var_freeze_step)
        self.var_update_scaler = max(1, whole_number("var_update_scaler", var_update_scaler))
        self.local_step_scaler = max(1, whole_number("local_step_scaler", local_step_scaler))
        self.local_step_clipper = max(1, whole_number("local_step_clipper", local_step_clipper))
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay},
                         cuda_aware=cuda_aware, comm_backend_name=comm_backend_name, group=group)

    def _schedule(self) -> dict:
        """The schedule's counters (kept in every parameter's state, as DeepSpeed does, so
        checkpoints carry them); the first parameter's stand for all."""
        for state in self.state.values():
            return state
        return {"step": 0, "var_interval": 1}

    def gradients_local(self) -> bool:
        """Every step but the full ones (Note [0/1 Adam's schedule])."""
        s = self._schedule()
        t = s["step"] + 1
        return t > self.var_freeze_step or t % s["var_interval"] != 0

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = self._evaluate(closure)
        t = self._schedule()["step"] + 1
        frozen = t > self.var_freeze_step
        full = not frozen and t % self._schedule()["var_interval"] == 0
        if frozen and t == self.var_freeze_step + 1:
            self._reset_errors()  # they held gradient errors; from now on they hold u's
        live = self._live_params(lambda p: {
            "var_interval": 1, "var_counter": 0, "local_step_interval": 1, "local_step_counter": 0,
            "lrs": 0.0, "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p),
            "anchor": torch.zeros_like(p)})
        if not live:
            return loss
        grads = [p.grad for p, _, _ in live]
        if not frozen and not full and self.world > 1:
            grads = [g.clone() for g in grads]
            self._average_compressed(grads)
        for (p, state, group), g in zip(live, grads):
            beta1, beta2 = group["betas"]
            if frozen and t == self.var_freeze_step + 1:
                state["anchor"].copy_(p)  # Note [0/1 Adam's anchor]
            state["exp_avg"].mul_(beta1).add_(g, alpha=1 - beta1)
            if full:
                state["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
            update = state["exp_avg"] / (state["exp_avg_sq"].sqrt() + group["eps"])
            if group["weight_decay"] > 0:
                update.add_(p, alpha=group["weight_decay"])
            p.add_(update, alpha=-group["lr"])
            if frozen:
                state["lrs"] += group["lr"]
        if frozen and t % live[0][1]["local_step_interval"] == 0:
            self._sync(live)
        for _, state, _ in live:
            self._advance(state, full, frozen)
        return loss

    def _sync(self, live: list) -> None:
        """Note [0/1 Adam's schedule], "sync": undo the local steps, apply their 1-bit average."""
        moves = []
        for p, state, group in live:
            denom = state["exp_avg_sq"].sqrt().add_(group["eps"])
            moves.append((p - state["anchor"]).mul_(denom))  # u * (sqrt(v) + eps)
        if self.world > 1:
            self._average_compressed(moves)
        for (p, state, group), u in zip(live, moves):
            denom = state["exp_avg_sq"].sqrt().add_(group["eps"])
            state["exp_avg"].copy_(u).div_(-state["lrs"])  # the momentum the average implies
            p.copy_(state["anchor"]).add_(u / denom)
            state["anchor"].copy_(p)
            state["lrs"] = 0.0

    def _advance(self, state: dict, full: bool, frozen: bool) -> None:
        if full:
            state["var_counter"] += 1
            if state["var_counter"] == self.var_update_scaler:
                state["var_counter"], state["var_interval"] = 0, state["var_interval"] * 2
        elif frozen:
            state["local_step_counter"] += 1
            if state["local_step_counter"] == self.local_step_scaler:
                state["local_step_counter"] = 0
                state["local_step_interval"] = min(self.local_step_clipper, state["local_step_interval"] * 2)
