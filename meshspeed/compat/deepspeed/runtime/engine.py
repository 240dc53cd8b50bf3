"""`deepspeed.runtime.engine`: DeepSpeed's engine, as `initialize` returns it.

meshspeed's engine (meshspeed/engine/engine.py) is the training loop and nothing else;
DeepSpeed's engine also answers some thirty getters that scripts and libraries call
(`engine.train_batch_size()`, `engine.get_lr()`, `engine.zero_optimization_stage()`, ...).
They live here, in `DeepSpeedEngineAPI`, a mixin over the loop: each is one line over the
typed config, the mesh or the loop's counters. `DeepSpeedEngine` is the loop with the
mixin, and the pipelined twin is in runtime/pipe/engine.py.
"""

from __future__ import annotations

import logging
import os

from meshspeed import comm
from meshspeed.checkpoint import engine_api
from meshspeed.checkpoint.paths import LATEST, META, list_tags, rank_file
from meshspeed.compression.scheduler import compression_scheduler
from meshspeed.data.loader import distributed_dataloader
from meshspeed.engine.engine import MeshspeedEngine
from meshspeed.parallel.protocol import GatheredCache, declares
from meshspeed.process.distributed import get_local_rank

__all__ = ["CallableInt", "DeepSpeedEngine", "DeepSpeedEngineAPI"]

log = logging.getLogger("meshspeed")


class CallableInt(int):
    """An int that returns itself when called: DeepSpeed's engine has methods
    (`engine.gradient_accumulation_steps()`) where other libraries read attributes; this
    value serves both spellings."""

    def __call__(self) -> int:
        return int(self)


class DeepSpeedEngineAPI:
    """DeepSpeed's engine getters over meshspeed's engine (`self` is a MeshspeedEngine)."""

    @property
    def gradient_accumulation_steps(self) -> CallableInt:
        return CallableInt(self.config.gradient_accumulation_steps)

    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def bfloat16_enabled(self) -> bool:
        return self.config.bf16.enabled

    def fp16_enabled(self) -> bool:
        return self.config.fp16.enabled

    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    def steps_per_print(self) -> int:
        return self.config.steps_per_print

    @property
    def zero_optimization_stage(self) -> CallableInt:
        return CallableInt(self.config.zero_stage)

    def zero_optimization(self) -> bool:
        return self.config.zero_stage > 0

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

    @property
    def local_rank(self) -> int:
        return get_local_rank()

    def get_lr(self) -> list[float]:
        return self.learning_rates()

    def get_global_grad_norm(self) -> float | None:
        return self.grad_norm

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale

    @property
    def dp_world_size(self) -> int:
        return self.topology.size("dp")

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

    def deepspeed_io(self, dataset, batch_size: int | None = None, route: str = "train",
                     pin_memory: bool = True, data_sampler=None, collate_fn=None,
                     num_local_io_workers: int | None = None):
        """A loader over this data-parallel rank's shard of `dataset`, as `initialize(training_data=...)`
        builds: micro batches of `batch_size` (default: the config's micro batch), reshuffled
        each epoch; a short last batch is dropped, as initialize's loader does. `route` and
        `pin_memory` are DeepSpeed's hints: the loader is the same for evaluation, and the
        script moves batches to the device."""
        if data_sampler is not None:
            raise NotImplementedError("deepspeed_io(data_sampler=...): meshspeed's loader shards the "
                                      "dataset over the data-parallel ranks itself; build a "
                                      "torch DataLoader with your sampler instead")
        return distributed_dataloader(
            dataset, batch_size or self.config.train_micro_batch_size_per_gpu,
            dp_rank=self.topology.coord("dp"), dp_size=self.topology.size("dp"),
            shuffle=not self.topology.size("pp") > 1,  # the pipeline reads in order, as initialize's
            collate_fn=collate_fn, num_workers=num_local_io_workers or 0)

    @property
    def compression_scheduler(self) -> compression_scheduler | None:
        """The compression_training schedule the engine steps, as DeepSpeed's attribute."""
        return next((c for c in self._callbacks if isinstance(c, compression_scheduler)), None)

    def save_16bit_model(self, save_dir, save_filename: str = "model.safetensors"):
        return engine_api.save_16bit_model(self, save_dir, save_filename)

    def _apply_step(self) -> None:
        """DeepSpeed's optimizer says whether the last boundary step was skipped (an fp16
        overflow) as `optimizer.overflow`; accelerate reads it to skip its own scheduler."""
        super()._apply_step()
        self.optimizer.overflow = not self._step_applied

    # -- what Hugging Face's Trainer and accelerate call when they save the model ---------------
    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """zero_optimization.stage3_gather_16bit_weights_on_model_save: whether saving the
        model may gather it whole (else the Trainer saves a checkpoint instead)."""
        return self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False):
        """The whole state_dict on rank 0 (None elsewhere); a collective (export.py)."""
        return engine_api.consolidated_state_dict(self, exclude_frozen_parameters)

    def _consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False):
        """The same for tensor-parallel (AutoTP) models: logical, whole tensors on rank 0."""
        return engine_api.consolidated_state_dict(self, exclude_frozen_parameters)

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False):
        """DeepSpeed's signature (the Trainer looks for `exclude_frozen_parameters` in it):
        with it, parameters that do not require grad are left out of the checkpoint and
        keep their values when it is loaded with load_module_strict=False."""
        return engine_api.save_checkpoint(self, save_dir, tag=tag, client_state=client_state,
                                          save_latest=save_latest, exclude_frozen=exclude_frozen_parameters)

    # Note [a load with no latest file]
    # DeepSpeed's `engine.load_checkpoint(dir)` with no tag and no `dir/latest` file logs a
    # warning and returns (None, None) without loading anything, and training scripts rely
    # on it: they create their checkpoint directory, call load_checkpoint(dir)
    # unconditionally and start from scratch on the first run. meshspeed's own load raises a
    # CheckpointError for a missing checkpoint (usually a wrong path). The DeepSpeed layer
    # takes DeepSpeed's return where the run is plainly a first one: the directory exists
    # and holds no complete checkpoint at all (rank 0 warns). A directory that does not
    # exist, or one with complete checkpoints but no `latest` (saved with
    # save_latest=False), is still an error that names the path and the tags found, since
    # loading nothing there would silently restart a run that has checkpoints. With
    # `checkpoint.auto_resume` a load without a tag returns (None, None) in every first-run
    # case (checkpoint/resume.py).
    def load_checkpoint(self, load_dir, tag=None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn=None):
        """DeepSpeed's load: as meshspeed's, except that an existing directory with no
        checkpoint in it loads nothing and returns (None, None) (Note [a load with no latest
        file])."""
        if custom_load_fn is not None:
            raise TypeError("load_checkpoint(custom_load_fn=...) is not supported by meshspeed: the "
                            "checkpoint is read by meshspeed's loader; load your extra state from "
                            "client_state, which load_checkpoint returns")
        if tag is None and not self.config.checkpoint.auto_resume and self._first_run(load_dir):
            return None, None
        return engine_api.load_checkpoint(self, load_dir, tag=tag, load_module_strict=load_module_strict,
                                          load_optimizer_states=load_optimizer_states,
                                          load_lr_scheduler_states=load_lr_scheduler_states,
                                          load_module_only=load_module_only)

    def _first_run(self, load_dir) -> bool:
        """Whether `load_dir` exists and holds no checkpoint (Note [a load with no latest
        file]); rank 0 looks, after any save in flight, and tells every rank."""
        engine_api.wait_for_pending(self)
        empty = None
        if comm.get_rank() == 0:
            directory = os.fspath(load_dir)
            empty = (os.path.isdir(directory) and not list_tags(directory)
                     and not any(os.path.isfile(os.path.join(directory, n)) for n in (LATEST, META)))
            if empty:
                log.warning("%s holds no %s file and no checkpoint: nothing loaded (a first run); "
                            "pass tag=... to load a given checkpoint", directory, LATEST)
        return bool(comm.broadcast_object(empty, src=0)) if comm.get_world_size() > 1 else bool(empty)

    def _get_optimizer_ckpt_name(self, checkpoints_path, tag, expp_rank: int = 0) -> str:
        """The file of checkpoint `tag` that holds this rank's optimizer state: in meshspeed's
        layout, this rank's `rank-NNNNN.safetensors` (which also holds its fp32 masters);
        `expp_rank` is accepted for DeepSpeed's signature (experts are in the same file)."""
        del expp_rank
        return os.path.join(os.fspath(checkpoints_path), str(tag), rank_file(self.global_rank))

    def empty_partition_cache(self) -> None:
        """Shard again the ZeRO stage-3 parameters a pass left gathered (the last block of a
        training forward, kept for its backward); nothing to do at other stages."""
        if declares(self.strategy, GatheredCache):
            self.strategy.release_gathered()

    @property
    def sparse_tensor_module_names(self) -> set[str]:
        """Modules whose gradients DeepSpeed reduces as sparse tensors: none, since meshspeed
        reduces every gradient dense (`sparse_gradients` is accepted and has no effect)."""
        return set()

class DeepSpeedEngine(DeepSpeedEngineAPI, MeshspeedEngine):
    """What `deepspeed.initialize` returns for a model that is not a PipelineModule."""
