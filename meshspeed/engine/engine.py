"""The training engine: a thin loop over composed parts.

It owns no parallel logic. `build.py` applies each axis and hands the engine what they
returned (`Composed`, parts.py); the engine calls the strategy at five points (micro-step
start, after backward, before and after the optimizer step, accounting), the other axes'
step parts before the step, and keeps the counters. DeepSpeed's getters
(`engine.train_batch_size()`, `get_lr()`, ...) are not here: they are the DeepSpeed layer's
(meshspeed/compat/deepspeed/runtime/engine.py), which is what `initialize` returns.
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch import nn

from meshspeed import comm
from meshspeed.checkpoint import engine_api
from meshspeed.checkpoint.pending import wait_for_pending
from meshspeed.engine.agreement import STEP_COUNTERS, agree
from meshspeed.engine.banner import step_line
from meshspeed.engine.errors import NoSyncError
from meshspeed.engine.observe import StepObserver
from meshspeed.engine.parts import Composed
from meshspeed.offload.tiers import add_tiers, resident_state_tensors
from meshspeed.parallel.gather import gathered
from meshspeed.parallel.memory import count_bytes
from meshspeed.parallel.protocol import Closeable, declares
from meshspeed.parallel.step import NormScope, StepGradients

log = logging.getLogger("meshspeed")


class MeshspeedEngine(nn.Module):
    """Use it like the model: `loss = engine(batch)`, `engine.backward(loss)`, `engine.step()`."""

    def __init__(self, parts: Composed):
        super().__init__()
        self.module = parts.module
        self.config, self.topology, self.strategy = parts.config, parts.mesh, parts.strategy
        self.optimizer, self.lr_scheduler, self.loss_scaler = parts.optimizer, parts.lr_scheduler, parts.scaler
        self.training_dataloader, self.comm_logger, self.device = parts.dataloader, parts.comm_logger, parts.device
        self.dp_group = self.topology.group("dp")
        self._forward = parts.forward
        self._step_parts, self._callbacks = parts.step_parts, parts.callbacks
        self._scope = NormScope()
        for part in self._step_parts:  # the ranks the norm and the overflow check cover
            self._scope = part.widen(self._scope, self.strategy)
        # Note [agreement before each step]: a rank agrees with its dp (x cp), tp and pp
        # peers, which together reach every rank
        self._agree_over = [self.topology.group(a) for a in ("dp_cp", "tp", "pp") if self.topology.size(a) > 1]
        # Note [agreement before a micro-step's forward]: where the forward communicates
        self._agree_each_forward = self.strategy.shards_params or any(
            self.topology.size(a) > 1 for a in ("tp", "cp", "ep"))
        self.global_steps = 0  # optimizer steps taken (skipped fp16 steps included, as in DeepSpeed)
        self.micro_steps = 0  # backward passes
        self.global_samples = 0
        self.skipped_steps = 0
        self.grad_norm: float | None = None  # the last step's global gradient norm (when clipping)
        self._micro_started = False
        self._micro_reduces = False  # what forward told the strategy: this backward reduces
        self._backward_done = False  # a backward ran since the last step()
        self._last_loss: torch.Tensor | None = None
        self._boundary_override: bool | None = None  # set_gradient_accumulation_boundary
        self._no_sync = False  # inside engine.no_sync()
        self._step_applied = False
        # wall_clock_breakdown, flops_profiler and the monitors (engine/observe.py); a
        # monitor whose package is missing raises here, at initialize, on every rank
        self._observer = StepObserver(self)

    @property
    def mesh(self):
        """The run's `meshspeed.topology.Topology`: its degrees (`mesh.dims`), this rank's
        group and coordinate on each axis (`mesh.group("tp")`, `mesh.coord("dp")`), the
        DeviceMesh (`mesh["tp"]`) and the sub-axis groups (`print(engine.mesh)`)."""
        return self.topology

    @property
    def timers(self):
        """`wall_clock_breakdown`'s StepTimers (meshspeed/profiling/timers.py), else None."""
        return self._observer.timers

    @property
    def flops_profile(self) -> dict | None:
        """Totals of the `flops_profiler` step once it has run."""
        return self._observer.profile_figures

    def learning_rates(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def checkpoint_skips(self) -> set[int]:
        """Masters a checkpoint leaves out: tied copies off their first stage (saved there)."""
        return set(self._scope.skip)

    # -- accumulation ---------------------------------------------------------------------
    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.config.gradient_accumulation_steps == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Take over the accumulation boundary (DeepSpeed's manual style): with False, any
        number of forward/backward passes accumulate without step(); set True before the
        last backward, then call step() once."""
        self._boundary_override = bool(is_boundary)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate gradients locally without reducing them; the
        first backward after the block reduces everything. Not with ZeRO stage 2 or 3
        (they shard gradients as they are produced), and step() inside is an error."""
        if self.config.zero_stage >= 2:  # Note [DeepSpeed's exception types] in errors.py
            raise NoSyncError(f"no_sync context manager is incompatible with ZeRO stage {self.config.zero_stage}: "
                              "stages 2 and 3 reduce-scatter each gradient as it is produced; use "
                              "gradient_accumulation_steps instead, or ZeRO stage 0 or 1")
        if self._no_sync:
            raise NoSyncError("no_sync context manager reentry is unsupported: engine.no_sync() blocks "
                              "cannot be nested; one block around every backward that should not reduce")
        self._no_sync = True
        try:
            yield
        finally:
            self._no_sync = False

    def was_step_applied(self) -> bool:
        """Whether the last step() changed the parameters (False between accumulation
        boundaries and for a skipped overflow step)."""
        return self._step_applied

    # -- the loop ---------------------------------------------------------------------------
    def _begin_micro_step(self, boundary: bool) -> None:
        self.strategy.begin_micro_step(boundary, self.loss_scaler.scale)

    def _reduces_now(self) -> bool:
        """Whether the coming backward reduces gradients (the boundary, outside no_sync)."""
        return self.is_gradient_accumulation_boundary() and not self._no_sync

    def forward(self, *inputs, **kwargs):
        if not self._micro_started:
            self._agree_before_forward()
            self._micro_reduces = self._reduces_now()
            self._begin_micro_step(self._micro_reduces)
            self._micro_started = True
        with self._observer.phase("forward", inputs):
            if self._forward is None:
                return self.module(*inputs, **kwargs)
            return self._forward.run(self.module, inputs, kwargs)

    def _agree_before_forward(self) -> None:
        """Note [agreement before a micro-step's forward] (agreement.py)."""
        skipped = self._backward_done and self._boundary_override is None and not self._no_sync
        if not (self._agree_each_forward or (skipped and self.is_gradient_accumulation_boundary())):
            return
        what = f"the forward of micro-step {self.micro_steps}"
        if skipped:
            what += " (no engine.step() after the last backward)"
        counters = dict(zip(STEP_COUNTERS, (self.global_steps, self.micro_steps, self.skipped_steps)))
        for group in self._agree_over:
            agree(what, counters, group=group, device=self.device, place="forward")

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backpropagate `loss`, averaged over accumulation steps and scaled for fp16.

        Returns the loss as averaged: `loss / gradient_accumulation_steps` (`loss` itself
        with `scale_wrt_gas=False`), never multiplied by the fp16 loss scale; as DeepSpeed."""
        if self._backward_done and self._boundary_override is None and not self._no_sync:
            raise RuntimeError(
                "engine.backward() called twice without engine.step() in between; call "
                "engine.step() after every backward: it counts the micro-step and applies the "
                f"optimizer only at the accumulation boundary (every {self.config.gradient_accumulation_steps} "
                "micro-steps here)")
        if self._no_sync and self._micro_started and self._micro_reduces:  # forward ran before no_sync
            self._begin_micro_step(False)
        elif not self._micro_started:  # forward ran outside the engine (engine.module(...))
            self._begin_micro_step(self._reduces_now())
        elif self._micro_reduces != self._reduces_now():
            # the boundary was set between forward and backward (accelerate calls
            # set_gradient_accumulation_boundary right before backward): the backward decides
            self._micro_reduces = self._reduces_now()
            self._begin_micro_step(self._micro_reduces)
        averaged = loss
        if scale_wrt_gas and self.config.gradient_accumulation_steps > 1:
            averaged = loss / self.config.gradient_accumulation_steps
        scaled = averaged * self.loss_scaler.scale if self.loss_scaler.scale != 1.0 else averaged
        with self._observer.phase("backward"):
            scaled.backward(retain_graph=retain_graph)
            self.strategy.finish_backward()
        self._observer.on_loss(loss)
        self._backward_done = self._backward_done or not self._no_sync  # no_sync's are carried on
        self._micro_started = False
        self._last_loss = loss.detach()
        return averaged

    def step(self) -> None:
        """Apply the optimizer at the accumulation boundary; a no-op on other micro-steps."""
        if self.config.checkpoint.async_save:  # a failed background save surfaces here
            engine_api.raise_pending_errors(self)
        if self._no_sync:
            raise NoSyncError("It is illegal to call Engine.step() inside no_sync context manager: "
                              "engine.step() inside engine.no_sync(); leave the block, run the last "
                              "backward outside it (that one reduces), then step()")
        self._step_applied = False
        if not self._backward_done:
            raise RuntimeError(
                "engine.step() called before engine.backward(): each micro-step is "
                "loss = engine(batch); engine.backward(loss); engine.step() (no step was taken; "
                f"the engine is at optimizer step {self.global_steps}, micro-step {self.micro_steps})")
        self._backward_done = False
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        self.global_samples += self.config.train_micro_batch_size_per_gpu * self.topology.size("dp")
        if boundary:
            self._apply_step()

    def _apply_step(self) -> None:
        """The optimizer step at an accumulation boundary, timed and reported (observe.py)."""
        with self._observer.phase("step"):
            self._optimizer_step()
        self._observer.after_step()

    def _optimizer_step(self) -> None:
        """Agree, finish the gradients, check, clip, step (Note [one contract for every axis])."""
        counters = dict(zip(STEP_COUNTERS, (self.global_steps, self.micro_steps, self.skipped_steps)))
        for group in self._agree_over:  # Note [agreement before each step]
            agree(f"optimizer step {self.global_steps}", counters, group=group, device=self.device)
        grads = self.strategy.prepare_step()
        for part in self._step_parts:
            part.before_step(self.strategy)
        check = self.config.fp16.enabled or self.config.check_finite
        scale = self.loss_scaler.scale
        overflow = check and grads.unscale_and_check(scale, self._scope, self.device)
        if not overflow:
            self._take_step(grads)
        self.loss_scaler.update(overflow)
        if overflow:
            self._report_skip(scale)
        self.optimizer.zero_grad(set_to_none=True)
        self.strategy.finish_step()
        self.global_steps += 1
        self._maybe_print()

    def _take_step(self, grads: StepGradients) -> None:
        if self.config.gradient_clipping > 0:
            norm = grads.norm(self._scope, self.device)
            grads.clip_(self.config.gradient_clipping, norm)
            self.grad_norm = float(norm)
        self.optimizer.step()
        self._step_applied = True
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        for callback in self._callbacks:  # applied steps only, as in DeepSpeed
            callback.step()

    def _report_skip(self, old_scale: float) -> None:
        self.skipped_steps += 1
        if comm.get_rank() != 0:
            return
        if self.config.fp16.enabled:
            log.warning("step %d: fp16 gradient overflow on some rank; step skipped on every rank, loss "
                        "scale %g -> %g", self.global_steps, old_scale, self.loss_scaler.scale)
        else:
            log.warning("step %d: non-finite (NaN/inf) gradients on some rank; step skipped on every "
                        "rank (check_finite)", self.global_steps)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As DeepSpeed's: drop the gradients accumulated since the last step that were not
        reduced yet (stage 0 and ZeRO 1 before the boundary backward, e.g. inside
        no_sync). A step's reduced gradients stay until step(), which clears them itself,
        so calling this after step() (as Hugging Face's Trainer does) costs nothing."""
        self.strategy.drop_unreduced()

    # -- reporting --------------------------------------------------------------------------
    def _maybe_print(self) -> None:
        every = self.config.steps_per_print
        if self.global_steps % every or comm.get_rank() != 0:
            return
        log.info("%s", step_line(self, self._last_loss, self._observer.window.take(self)))
        if self.comm_logger is not None:
            log.info("communication in the last %d steps:\n%s", every, self.comm_logger.format_table())
            self.comm_logger.reset()

    def memory_breakdown(self) -> dict:
        """Bytes held for this rank, by category and by where they live.

        Returns a dict with every key below, always (a category with nothing in it is 0):

        - "params" (int): the parameters this rank keeps, whole below stage 3, this rank's
          shard at stage 3.
        - "gathered_params" (int): stage 3 only: whole parameters all-gathered from the
          shards and still resident when this is called.
        - "master_params" (int): fp32 master weights of bf16/fp16 training (0 in fp32,
          where the masters are the parameters).
        - "grads" (int): gradients held now: full, or this rank's slice from stage 2,
          including an offloaded optimizer's host copy.
        - "optimizer_state" (int): the optimizer's state (Adam's moments and step counts);
          with NVMe offload, the swap files' sizes plus the resident swap buffers.
        - "comm_buffers" (int): flat buffers and buckets kept for communication.
        - "total" (int): the sum of the six categories above.
        - "tiers" (dict, the one nested value): {"device": int, "host": int, "nvme": int},
          the same bytes split by location; the three sum to "total". "host" is state
          that offload placed in host memory (on an accelerator, anything in CPU memory),
          "nvme" the swap files' sizes on disk, "device" the rest. On a CPU-only machine
          only offloaded state is "host" (meshspeed/offload/tiers.py).

        Each storage is counted once, in the first category above that names it (a master
        that aliases a parameter is "params"); NVMe bytes count in their category too
        ("optimizer_state", or "params" for swapped stage-3 shards). Code that walks the
        values must skip "tiers" (a dict) and "total" (a sum). See docs/memory.md."""
        tensors = self.strategy.memory_tensors()
        tensors.setdefault("optimizer_state", resident_state_tensors(self.optimizer))
        out = count_bytes(tensors)
        out["total"] = sum(out.values())
        return add_tiers(out, tensors, self.strategy, self.optimizer)

    def peak_gathered_bytes(self) -> int:
        return self.strategy.peak_gathered_bytes()

    # -- checkpoints (meshspeed.checkpoint does the work) -------------------------------------
    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest: bool = True):
        return engine_api.save_checkpoint(self, save_dir, tag=tag, client_state=client_state,
                                          save_latest=save_latest)

    def load_checkpoint(self, load_dir, tag=None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False):
        return engine_api.load_checkpoint(self, load_dir, tag=tag, load_module_strict=load_module_strict,
                                          load_optimizer_states=load_optimizer_states,
                                          load_lr_scheduler_states=load_lr_scheduler_states,
                                          load_module_only=load_module_only)

    # -- end of training --------------------------------------------------------------------
    def destroy(self) -> None:
        """Finish background work and release what it holds: waits for an asynchronous
        checkpoint save (raising its failure on every rank: call on every rank), publishes
        a delayed offload update, and closes offload swap files."""
        wait_for_pending(self)
        self._observer.close()
        self.strategy.flush()
        if declares(self.optimizer, Closeable):  # an offloaded optimizer's swap files
            self.optimizer.close()
        self.strategy.close()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.destroy()
        return False

    # -- nn.Module plumbing -----------------------------------------------------------------
    def __getattr__(self, name: str):
        """Attributes the engine lacks come from the model, as DeepSpeed's engine does
        (`engine.gradient_checkpointing_enable()`, `engine.config_class`, ...)."""
        try:
            return super().__getattr__(name)  # parameters, buffers, submodules of the engine
        except AttributeError:
            modules = self.__dict__.get("_modules", {})
            if "module" not in modules or name.startswith("__"):
                raise
            return getattr(modules["module"], name)

    def train(self, mode: bool = True):
        self.module.train(mode)
        self.training = mode
        return self

    def eval(self):
        return self.train(False)

    def state_dict(self, *args, **kwargs):
        """The module's state_dict with real, whole tensors under every stage (under ZeRO-3
        the parameters are gathered and copied: a collective, and a full copy in memory)."""
        if not self.strategy.shards_params:
            return self.module.state_dict(*args, **kwargs)
        with gathered(list(self.module.parameters())):
            return {k: v.detach().clone() for k, v in self.module.state_dict(*args, **kwargs).items()}

    def load_state_dict(self, state_dict, strict: bool = True):
        """Load whole tensors into the module; under ZeRO-3 each rank keeps its slices."""
        with gathered(list(self.module.parameters()), modifier_rank=0):
            return self.module.load_state_dict(state_dict, strict=strict)
