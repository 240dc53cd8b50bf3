"""1-bit Adam (Tang et al., arXiv:2102.02888): Adam whose momentum is averaged in 1 bit.

Note [1-bit Adam's two phases]
Warm-up, steps 1..freeze_step: the engine all-reduces the gradients in fp32 as for any
optimizer, and this is Adam: m = b1 m + (1-b1) g, v = b2 v + (1-b2) g^2.
Compressed, every later step: v is frozen (the paper's observation: after warm-up Adam's
variance changes slowly, so it can act as a fixed preconditioner), the engine leaves the
gradients local (`gradients_local()` tells the strategy, Note [gradients left local] in
parallel/data/ddp.py), each rank folds its own gradient into its momentum, and the momenta
are averaged by `meshspeed.comm.compressed.CompressedAllReduce`: error-compensated signs,
1 bit per element plus scales, two stages. Every rank ends with the same momentum, so
parameters stay identical.
The update in both phases is DeepSpeed's (OnebitAdam in 0.x): p -= lr * (m / (sqrt(v) + eps)
+ weight_decay * p); there is no bias correction (DeepSpeed accepts `bias_correction`
and ignores it, so do we), and weight decay is decoupled, added to the update.
A single rank has no one to talk to: momentum is then used as is (DeepSpeed too).
Where meshspeed differs from DeepSpeed 0.x, on purpose:
* DeepSpeed's first `step()` is an initialisation call that counts a step but leaves the
  parameters unchanged (the first gradient is dropped); here the first step is Adam's.
* DeepSpeed compresses each parameter's momentum in its own call (4 collectives per
  tensor); here one call takes all of them, 4 collectives per step, with the same
  arithmetic: each tensor padded alone, its own worker and server scales
  (Note [layout of the compressed buffer] in comm/compressed.py).
* `exp_avg_mask` (a group option DeepSpeed's BERT example sets) is refused, not built yet.
* `bias_corrected_freeze` (off by default), Note [bias-corrected variance freeze].
* With local gradients, gradient clipping uses one coefficient on every rank, from the root
  mean square of the ranks' local norms, and a non-finite gradient on any rank skips the
  step everywhere (Note [gradients left local] in parallel/data/ddp.py); DeepSpeed clips
  each rank by its own local norm.

Note [bias-corrected variance freeze]
`bias_corrected_freeze: true` (a config key of meshspeed's, in neither the paper nor
DeepSpeed) changes one thing: at the end of step freeze_step, v is divided by
1 - beta2^freeze_step, Adam's bias correction, once; the compressed phase divides by the
root of that. The warm-up steps stay DeepSpeed's. A variance frozen after k steps then
estimates the running second moment instead of (1 - beta2^k) of it, so compressed steps
are Adam-sized at any freeze_step instead of 1/sqrt(1 - beta2^k) times larger (Note [a
variance frozen too early]). Checkpoints taken after the freeze hold the corrected v.
On issue 34's run (tests/optim/test_onebit_freeze.py) freeze_step 5 then ends at 5.66
(mean of the last 5 steps; AdamW 5.62) where the uncorrected algorithm goes to NaN; 2 to
29 all train; 1 does not (v is then one squared gradient, near 0 wherever that gradient
was, and those elements take huge steps).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch

from meshspeed import comm
from meshspeed.comm.compressed import CompressedAllReduce

__all__ = ["COMM_BACKENDS", "CompressedOptimizer", "OneBitAdam"]

log = logging.getLogger("meshspeed")

# DeepSpeed's comm_backend_name values; each means "the data-parallel group's backend" here
COMM_BACKENDS = ("nccl", "mpi", "hccl", "compressed")


def whole_number(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"optimizer.params.{name}: expected a whole number >= 0, got {value!r}")
    return value


def safe_freeze_step(beta2: float) -> int:
    """The smallest `freeze_step` k whose frozen variance keeps at least half of its running
    value, 1 - beta2^k >= 1/2, so that compressed steps are at most sqrt(2) times Adam's
    (Note [a variance frozen too early]): k = ceil(ln(1/2) / ln(beta2)), 693 at 0.999."""
    if not 0 < beta2 < 1:
        return 0
    return math.ceil(math.log(0.5) / math.log(beta2) - 1e-9)


def warn_short_warmup(name: str, freeze_step: int, beta2: float, bias_corrected: bool = False) -> None:
    """Note [a variance frozen too early]: without bias correction the second moment after
    k steps is (1 - beta2^k) of its running value, and the compressed phase divides by its
    root for the rest of training, so each compressed step is 1/sqrt(1 - beta2^k) times
    Adam's (14x at k = 5, beta2 0.999). This is the published algorithm (arXiv:2102.02888,
    Alg. 1, transcribed in tests/optim/test_onebit_freeze.py) and DeepSpeed's, not a defect
    of the compression: on issue 34's run (GPT-2 shape, vocabulary 1000, 2 ranks, lr 1e-3,
    freeze_step 5 of 30) the transcription's loss goes from 6.92 to over 1000, and to NaN
    with the momentum averaged exactly. The smallest safe freeze_step, `safe_freeze_step`,
    is the first k with 1 - beta2^k >= 1/2 (compressed steps at most sqrt(2) times Adam's):
    693 at 0.999, whatever the run's length, which the optimizer does not know. It is a
    bound, not a measurement: on issue 34's 30-step run freeze_step 1-10 went to NaN, 15
    spiked to 9.1 and ended at 6.49, 20 and more trained (AdamW: 5.62). Shorter
    warm-ups need `bias_corrected_freeze` (Note [bias-corrected variance freeze]), which
    removes the shrinkage, so no warning is given then. A warning on rank 0, not an error:
    short runs and tests warm up briefly on purpose."""
    share = 1.0 - beta2 ** freeze_step
    if bias_corrected or share >= 0.5 or (comm.is_initialized() and comm.get_rank() != 0):
        return
    log.warning("%s freeze_step %d: the variance frozen after it is %.1f%% of its running value (no bias "
                "correction, betas[1] %g), so every compressed step is %.0fx Adam's; 1-bit Adam diverges "
                "this way by its paper's own algorithm. The smallest safe freeze_step is %d (the first k "
                "with 1 - betas[1]^k >= 1/2: compressed steps at most 1.4x Adam's). For a shorter warm-up "
                "set optimizer.params.bias_corrected_freeze: true, which freezes v / (1 - betas[1]^"
                "freeze_step) instead (a meshspeed option, not in the paper or DeepSpeed)",
                name, freeze_step, 100 * share, beta2, 1 / math.sqrt(max(share, 1e-12)),
                safe_freeze_step(beta2))


class CompressedOptimizer(torch.optim.Optimizer):
    """What 1-bit Adam, 0/1 Adam and 1-bit LAMB share: DeepSpeed's transport params (accepted, logged),
    the data-parallel `group`, flat compressed all-reduces with their error buffers, and
    `gradients_local()`, which the stage-0 strategy asks before each boundary reduction."""

    def __init__(self, params, defaults: dict, *, cuda_aware: bool, comm_backend_name: str, group: Any):
        if comm_backend_name not in COMM_BACKENDS:
            raise ValueError(f"optimizer.params.comm_backend_name: {comm_backend_name!r} is not one "
                             f"of DeepSpeed's {list(COMM_BACKENDS)}")
        if comm.is_initialized() and comm.get_rank() == 0 and (cuda_aware or comm_backend_name != "nccl"):
            log.info("%s: cuda_aware=%s, comm_backend_name=%r have no effect; the compressed "
                     "all-reduce runs over the data-parallel group's backend", type(self).__name__,
                     cuda_aware, comm_backend_name)
        super().__init__(params, defaults)
        if any("exp_avg_mask" in g for g in self.param_groups):
            raise ValueError(f"{type(self).__name__}: the parameter-group option exp_avg_mask is not "
                             "built yet in meshspeed; drop it (its momentum then also covers the "
                             "masked elements)")
        self.group = group
        self.world = comm.get_world_size(group) if comm.is_initialized() else 1
        self._allreduce: CompressedAllReduce | None = None  # built on the first compressed call

    def steps_taken(self) -> int:
        """Optimizer steps applied so far (kept per parameter in `state`, so checkpoints carry it)."""
        for state in self.state.values():
            return int(state["step"])
        return 0

    def gradients_local(self) -> bool:
        """Whether the coming step wants this rank's own gradients (no fp32 all-reduce): after
        `freeze_step` steps, every step (1-bit Adam and LAMB; 0/1 Adam has its own schedule)."""
        return self.steps_taken() >= self.freeze_step

    @staticmethod
    def _evaluate(closure: Callable[[], float] | None) -> float | None:
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def _live_params(self, new_state: Callable[[torch.Tensor], dict]) -> list[tuple]:
        """(param, state, group) of every parameter with a gradient this step: checked, its
        state made by `new_state(p)` on first sight, its step counted."""
        live = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                self._check(p)
                state = self.state[p]
                if not state:
                    state.update(step=0, **new_state(p))
                state["step"] += 1
                live.append((p, state, group))
        return live

    def _check(self, p: torch.Tensor) -> None:
        if p.grad.is_sparse or p.dtype != torch.float32:
            raise TypeError(f"{type(self).__name__} steps on dense fp32 tensors only "
                            f"(got {p.dtype}{', sparse' if p.grad.is_sparse else ''})")

    def _average_compressed(self, tensors: list[torch.Tensor], one_scale: bool = False) -> None:
        """Replace `tensors` by their 1-bit average over the group: one scale per tensor, or
        with `one_scale` one for all of them, as one flat tensor (1-bit LAMB's choice)."""
        if one_scale:
            flat = torch.cat([t.reshape(-1) for t in tensors])
            self._average_compressed([flat])
            offset = 0
            for t in tensors:
                t.copy_(flat[offset: offset + t.numel()].view_as(t))
                offset += t.numel()
            return
        sizes = [t.numel() for t in tensors]
        if self._allreduce is None:
            self._allreduce = CompressedAllReduce(sizes, self.group, tensors[0].device)
        elif self._allreduce.sizes != sizes:
            raise RuntimeError(f"{type(self).__name__}: the set of parameters with gradients changed; "
                               "the error-feedback buffers no longer line up")
        self._allreduce(tensors)

    def _reset_errors(self) -> None:
        if self._allreduce is not None:
            self._allreduce.reset()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load moments and step counts; the compression errors restart from zero (they
        differ per rank and are not saved, as in DeepSpeed)."""
        super().load_state_dict(state_dict)
        self._reset_errors()


class OneBitAdam(CompressedOptimizer):
    """DeepSpeed's `OnebitAdam` params over meshspeed's compressed all-reduce on `group`.

    `freeze_step`: the number of warm-up steps with full-precision gradients (DeepSpeed's
    default, 100000, is meant for long pre-training runs). `cuda_aware` and
    `comm_backend_name` choose DeepSpeed's transport; meshspeed has one, over `group`."""

    def __init__(self, params, lr: float = 1e-3, freeze_step: int = 100000,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, bias_correction: bool = True, cuda_aware: bool = False,
                 comm_backend_name: str = "nccl", bias_corrected_freeze: bool = False, group: Any = None):
        self.freeze_step = whole_number("freeze_step", freeze_step)
        if not isinstance(bias_corrected_freeze, bool):
            raise ValueError("optimizer.params.bias_corrected_freeze: expected true or false, got "
                             f"{bias_corrected_freeze!r}")
        self.bias_corrected_freeze = bias_corrected_freeze
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay},
                         cuda_aware=cuda_aware, comm_backend_name=comm_backend_name, group=group)
        warn_short_warmup(type(self).__name__, self.freeze_step, betas[1], bias_corrected_freeze)

    # -- the step ----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = self._evaluate(closure)
        compressed = self.gradients_local()
        live = self._live_params(lambda p: {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)})
        for p, state, group in live:
            beta1, beta2 = group["betas"]
            state["exp_avg"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
            if not compressed:  # Note [1-bit Adam's two phases]: v frozen afterwards
                state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
        if compressed and self.world > 1 and live:
            self._average_compressed([state["exp_avg"] for _, state, _ in live])
        for p, state, group in live:
            update = state["exp_avg"] / (state["exp_avg_sq"].sqrt() + group["eps"])
            if group["weight_decay"] > 0:
                update.add_(p, alpha=group["weight_decay"])
            p.add_(update, alpha=-group["lr"])
            if self.bias_corrected_freeze and state["step"] == self.freeze_step:
                # Note [bias-corrected variance freeze]: what the compressed phase divides by
                state["exp_avg_sq"].div_(1 - group["betas"][1] ** state["step"])
        return loss
