"""The training engine: a thin loop over composed parts.

It owns no parallel logic. `build.py` decides which strategy shards what; the engine calls
the strategy at five points (micro-step start, after backward, before/after the optimizer
step, accounting) and keeps the counters DeepSpeed users expect.
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch import nn

from meshspeed import comm
from meshspeed.compression.scheduler import engine_scheduler
from meshspeed.config.errors import ConfigError
from meshspeed.engine.agreement import STEP_COUNTERS, agree
from meshspeed.parallel.memory import count_bytes
from meshspeed.engine.observe import StepObserver
from meshspeed.engine.tp_grads import TensorParallelGrads
from meshspeed.offload.tiers import add_tiers, resident_state_tensors
from meshspeed.optim.clip import clip_by_norm_, clip_coef, global_grad_norm
from meshspeed.optim.precision import unscale_and_check
from meshspeed.parallel.gather import gathered

log = logging.getLogger("meshspeed")


class CallableInt(int):
    """An int that returns itself when called: DeepSpeed's engine has methods
    (`engine.gradient_accumulation_steps()`) where meshspeed's code and other libraries
    read attributes; this value serves both spellings."""

    def __call__(self) -> int:
        return int(self)


class MeshspeedEngine(nn.Module):
    """What `meshspeed.initialize` returns first. Use it like the model:
    `loss = engine(batch)`, `engine.backward(loss)`, `engine.step()`."""

    def __init__(self, *, module, config, strategy, optimizer, lr_scheduler, scaler, topology,
                 dataloader=None, comm_logger=None, device=None):
        super().__init__()
        self.module = module
        self.config = config
        self.strategy = strategy
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.loss_scaler = scaler
        self.topology = topology
        self.dp_group = topology.group("dp")
        self._tp = TensorParallelGrads(module, strategy.master_of, topology.group("tp"), topology.size("tp"))
        if self._tp.has_partial and strategy.deferred_grads() is not None:
            raise ConfigError([("tensor_parallel.sequence_parallel with offload_optimizer.device "
                               "\"nvme\": the partial gradients of sequence-parallel norms are summed "
                               "over tp in memory, and NVMe offload keeps gradients in files; use "
                               "offload_optimizer.device \"cpu\" or turn sequence_parallel off")])
        # Note [agreement before each step]: with tensor parallelism a rank agrees with its
        # dp peers and its tp peers, which together reach every rank
        self._agree_over = [topology.group(a) for a in ("dp_cp", "tp") if topology.size(a) > 1]
        self.training_dataloader = dataloader
        self.comm_logger = comm_logger
        self.device = device or torch.device("cpu")
        self.global_steps = 0  # optimizer steps taken (skipped fp16 steps included, as in DeepSpeed)
        self.micro_steps = 0  # backward passes
        self.global_samples = 0
        self.skipped_steps = 0
        self._grad_norm: float | None = None
        self._micro_started = False
        self._micro_reduces = False  # what forward told the strategy: this backward reduces
        self._backward_done = False  # a backward ran since the last step()
        self._last_loss: torch.Tensor | None = None
        self._boundary_override: bool | None = None  # set_gradient_accumulation_boundary
        self._no_sync = False  # inside engine.no_sync()
        self._step_applied = False
        self._stage_groups: list = []  # set by the pipeline engine: [pp group]
        self._norm_skip: set[int] = set()  # masters left out of the gradient norm
        self.context = None  # meshspeed.sequence.context.ContextParallel under context parallelism
        self._cuts_batches = False
        # compression_training: starts techniques at their schedule_offset (DeepSpeed's name)
        self.compression_scheduler = engine_scheduler(module, config, topology.size("tp"))
        # wall_clock_breakdown, flops_profiler and the monitors (engine/observe.py); a
        # monitor whose package is missing raises here, at initialize, on every rank
        self._observer = StepObserver(self)

    @property
    def timers(self):
        """`wall_clock_breakdown`'s StepTimers (meshspeed/profiling/timers.py), else None:
        `timers.last_step` holds the last optimizer step's seconds per phase."""
        return self._observer.timers

    @property
    def flops_profile(self) -> dict | None:
        """Totals of the `flops_profiler` step once it has run: flops, forward_flops,
        params, forward_seconds."""
        return self._observer.profile_figures

    def attach_context(self, context, cuts_batches: bool) -> None:
        """Context parallelism: forward cuts each batch for this rank (unless the model
        calls DistributedAttention itself and its script cuts them, as under DeepSpeed)."""
        self.context, self._cuts_batches = context, cuts_batches

    def _reduce_tied(self) -> None:
        """Hook for the pipeline engine (tied layers across stages); nothing here."""

    # -- DeepSpeed-compatible accessors ---------------------------------------------------
    @property
    def gradient_accumulation_steps(self) -> CallableInt:
        """An int; DeepSpeed scripts call it (`engine.gradient_accumulation_steps()`), others
        read it: both work (CallableInt)."""
        return CallableInt(self.config.gradient_accumulation_steps)

    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.gradient_accumulation_steps == 0

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
        if self.config.zero_stage >= 2:
            raise RuntimeError(f"engine.no_sync() cannot be used with ZeRO stage {self.config.zero_stage}: "
                               "stages 2 and 3 reduce-scatter each gradient as it is produced; use "
                               "gradient_accumulation_steps instead, or ZeRO stage 0 or 1")
        if self._no_sync:
            raise RuntimeError("engine.no_sync() blocks cannot be nested")
        self._no_sync = True
        try:
            yield
        finally:
            self._no_sync = False

    def was_step_applied(self) -> bool:
        """Whether the last step() changed the parameters (False between accumulation
        boundaries and for a skipped overflow step)."""
        return self._step_applied

    def bfloat16_enabled(self) -> bool:
        return self.config.bf16.enabled

    def fp16_enabled(self) -> bool:
        return self.config.fp16.enabled

    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    def steps_per_print(self) -> int:
        return self.config.steps_per_print

    def zero_optimization_partition_gradients(self) -> bool:
        return self.config.zero_stage >= 2

    def zero_optimization_partition_weights(self) -> bool:
        return self.config.zero_stage >= 3

    def zero_offload_optimizer(self) -> bool:
        o = self.config.zero_optimization.offload_optimizer
        return o is not None and o.device != "none"

    def zero_offload_param(self) -> bool:
        o = self.config.zero_optimization.offload_param
        return self.config.zero_stage == 3 and o is not None and o.device != "none"

    @property
    def global_rank(self) -> int:
        return comm.get_rank() if comm.is_initialized() else 0

    @property
    def world_size(self) -> int:
        return comm.get_world_size() if comm.is_initialized() else 1

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        return self._grad_norm

    @property
    def zero_optimization_stage(self) -> CallableInt:
        """An int that can also be called, as DeepSpeed scripts do (CallableInt)."""
        return CallableInt(self.config.zero_stage)

    def zero_optimization(self) -> bool:
        return self.config.zero_stage > 0

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale

    @property
    def local_rank(self) -> int:
        from meshspeed.process.distributed import get_local_rank

        return get_local_rank()

    @property
    def dp_world_size(self) -> int:
        return comm.get_world_size(self.dp_group)

    @property
    def mesh(self):
        """The run's `meshspeed.topology.Topology`: its degrees (`mesh.dims`), this rank's
        group and coordinate on each axis (`mesh.group("tp")`, `mesh.coord("dp")`) and the
        DeviceMesh (`mesh["tp"]`)."""
        return self.topology

    def get_data_parallel_group(self):
        return self.dp_group

    # DeepSpeed's names for the sequence (context-parallel) axis
    @property
    def seq_parallel_group(self):
        return self.topology.group("cp")

    def get_sequence_parallel_group(self):
        return self.topology.group("cp")

    @property
    def sequence_parallel_size(self) -> int:
        return self.topology.size("cp")

    @property
    def seq_dp_world_size(self) -> int:
        """Ranks gradients are averaged over: data x sequence parallel."""
        return self.topology.size("dp_cp")

    def get_tensor_parallel_group(self):
        return self.topology.group("tp")

    def get_model_parallel_world_size(self) -> int:
        return self.topology.size("tp")

    # -- the loop ---------------------------------------------------------------------------
    def _reduces_now(self) -> bool:
        """Whether the coming backward reduces gradients (the boundary, outside no_sync)."""
        return self.is_gradient_accumulation_boundary() and not self._no_sync

    def forward(self, *inputs, **kwargs):
        if not self._micro_started:
            self._micro_reduces = self._reduces_now()
            self.strategy.begin_micro_step(self._micro_reduces)
            self._micro_started = True
        with self._observer.phase("forward", inputs):
            return self._run_module(inputs, kwargs)

    def _run_module(self, inputs, kwargs):
        if self._cuts_batches:  # Note [cutting a batch for context parallelism]
            from meshspeed.sequence.data import cut_batch, weigh_loss

            inputs, kwargs, weight = cut_batch(self.context, self.module, inputs, kwargs)
            return weigh_loss(self.context, self.module(*inputs, **kwargs), weight)
        return self.module(*inputs, **kwargs)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True):
        """Backpropagate `loss`, averaged over accumulation steps and scaled for fp16."""
        if self._backward_done and self._boundary_override is None and not self._no_sync:
            raise RuntimeError(
                "engine.backward() called twice without engine.step() in between; call "
                "engine.step() after every backward: it counts the micro-step and applies the "
                f"optimizer only at the accumulation boundary (every {self.gradient_accumulation_steps} "
                "micro-steps here)")
        if self._no_sync and self._micro_started and self._micro_reduces:  # forward ran before no_sync
            self.strategy.begin_micro_step(False)
        elif not self._micro_started:  # forward ran outside the engine (engine.module(...))
            self.strategy.begin_micro_step(self._reduces_now())
        scaled = loss
        if scale_wrt_gas and self.gradient_accumulation_steps > 1:
            scaled = scaled / self.gradient_accumulation_steps
        if self.loss_scaler.scale != 1.0:
            scaled = scaled * self.loss_scaler.scale
        deferred = self.strategy.deferred_grads()
        if deferred is not None:  # gradients land in files, unscaled on the way
            deferred.loss_scale = self.loss_scaler.scale
        with self._observer.phase("backward"):
            scaled.backward(retain_graph=retain_graph)
            self.strategy.finish_backward()
        self._observer.on_loss(loss)
        self._backward_done = self._backward_done or not self._no_sync  # no_sync's are carried on
        self._micro_started = False
        self._last_loss = loss.detach()
        return loss

    def step(self) -> None:
        """Apply the optimizer at the accumulation boundary; a no-op on other micro-steps."""
        if self.config.checkpoint.async_save:  # a failed background save surfaces here
            from meshspeed.checkpoint.engine_api import raise_pending_errors

            raise_pending_errors(self)
        if self._no_sync:
            raise RuntimeError("engine.step() inside engine.no_sync(): leave the block, run the "
                               "last backward outside it (that one reduces), then step()")
        self._step_applied = False
        if not self._backward_done:
            raise RuntimeError(
                "engine.step() called before engine.backward(): each micro-step is "
                "loss = engine(batch); engine.backward(loss); engine.step() (no step was taken; "
                f"the engine is at optimizer step {self.global_steps}, micro-step {self.micro_steps})")
        self._backward_done = False
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        self.global_samples += self.train_micro_batch_size_per_gpu() * self.dp_world_size
        if not boundary:
            return
        self._apply_step()

    def _norm_weights(self, masters: list) -> list[float] | None:
        """The strategy's per-gradient weights of the global norm (stage 0 with expert
        parallelism), None for strategies whose shards are disjoint."""
        weights = getattr(self.strategy, "grad_norm_weights", None)
        return None if weights is None else weights(masters)

    def _apply_step(self) -> None:
        """The optimizer step at an accumulation boundary, timed and reported (observe.py)."""
        with self._observer.phase("step"):
            self._optimizer_step()
        self._observer.after_step()

    def _optimizer_step(self) -> None:
        """The optimizer step at an accumulation boundary: agree, reduce, check, clip, step."""
        # Note [agreement before each step]
        counters = dict(zip(STEP_COUNTERS, (self.global_steps, self.micro_steps, self.skipped_steps)))
        for group in self._agree_over:
            agree(f"optimizer step {self.global_steps}", counters, group=group, device=self.device)
        masters = self.strategy.prepare_step()
        self._tp.reduce_partial()  # Note [partial gradients of sequence-parallel norms]
        self._reduce_tied()
        masters = [m for m in masters if m.grad is not None]
        grads = [m.grad for m in masters]
        # with pipeline stages, each stage holds its own layers' gradients: sum over pp too
        groups = [*self.strategy.grad_norm_groups(), *self._stage_groups]
        check = self.config.fp16.enabled or self.config.check_finite
        check_over = [*groups, *([self._tp.group] if self._tp.active else [])]
        deferred = self.strategy.deferred_grads()  # Note [gradients in their NVMe slot]
        if deferred is not None:  # placeholders stand for gradients in files, already unscaled
            grads = [m.grad for m in masters if not deferred.holds_grad(m)]
        overflow = unscale_and_check(grads, self.loss_scaler.scale, check_over, self.device,
                                     local=deferred is not None and deferred.nonfinite) if check else False
        if overflow and not self.config.fp16.enabled and comm.get_rank() == 0:
            log.warning("step %d: non-finite (NaN/inf) gradients on some rank; step skipped on "
                        "every rank (check_finite)", self.global_steps)
        if overflow:
            self.skipped_steps += 1
            old_scale = self.loss_scaler.scale
        else:
            if self.config.gradient_clipping > 0:
                counted = [m for m in masters if id(m) not in self._norm_skip]  # tied copies once
                norm = global_grad_norm([m.grad for m in counted] if deferred is None else [], groups,
                                        self.device, tp_group=self._tp.group,
                                        tp_split=self._tp.split_mask(counted),
                                        norms=None if deferred is None else deferred.norms(counted),
                                        weights=self._norm_weights(counted))
                clip_by_norm_(grads, self.config.gradient_clipping, norm)
                if deferred is not None:
                    deferred.clip_(clip_coef(self.config.gradient_clipping, norm))
                self._grad_norm = float(norm)
            self.optimizer.step()
            self._step_applied = True
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
            if self.compression_scheduler is not None:  # applied steps only, as in DeepSpeed
                self.compression_scheduler.step()
        self.loss_scaler.update(overflow)
        if overflow and self.config.fp16.enabled and comm.get_rank() == 0:
            log.warning("step %d: fp16 gradient overflow on some rank; step skipped on every "
                        "rank, loss scale %g -> %g", self.global_steps, old_scale,
                        self.loss_scaler.scale)
        self.optimizer.zero_grad(set_to_none=True)
        self.strategy.finish_step()
        self.global_steps += 1
        self._maybe_print()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients are managed per step by the engine; kept for API compatibility."""

    # -- reporting --------------------------------------------------------------------------
    def _maybe_print(self) -> None:
        every = self.config.steps_per_print
        if self.global_steps % every or comm.get_rank() != 0:
            return
        loss = float(self._last_loss) if self._last_loss is not None else float("nan")
        log.info("step %d: loss %.4f lr %s", self.global_steps, loss,
                 ", ".join(f"{lr:.3g}" for lr in self.get_lr()))
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
        from meshspeed.checkpoint.engine_api import save_checkpoint

        return save_checkpoint(self, save_dir, tag=tag, client_state=client_state,
                               save_latest=save_latest)

    def load_checkpoint(self, load_dir, tag=None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False):
        from meshspeed.checkpoint.engine_api import load_checkpoint

        return load_checkpoint(self, load_dir, tag=tag, load_module_strict=load_module_strict,
                               load_optimizer_states=load_optimizer_states,
                               load_lr_scheduler_states=load_lr_scheduler_states,
                               load_module_only=load_module_only)

    def save_16bit_model(self, save_dir, save_filename: str = "model.safetensors"):
        from meshspeed.checkpoint.engine_api import save_16bit_model

        return save_16bit_model(self, save_dir, save_filename)

    # -- end of training --------------------------------------------------------------------
    def destroy(self) -> None:
        """Finish background work and release what it holds: waits for an asynchronous
        checkpoint save (raising its failure on every rank: call on every rank), publishes
        a delayed offload update, and closes offload swap files."""
        from meshspeed.checkpoint.pending import wait_for_pending
        from meshspeed.offload.optimizer import OffloadOptimizer

        wait_for_pending(self)
        self._observer.close()
        self.strategy.flush()
        if isinstance(self.optimizer, OffloadOptimizer):
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
