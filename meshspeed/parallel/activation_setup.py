"""DeepSpeed's `deepspeed.checkpointing.configure()` and the settings it holds.

`configure(mpu_, deepspeed_config=..., partition_activations=..., ...)` sets how
`checkpoint()` keeps inputs, for the whole process, as DeepSpeed's does: from the
config's `activation_checkpointing` block, each explicit argument overriding the
block's value. `mpu_` gives the tensor-parallel group: a Megatron-style mpu
(`get_tensor_model_parallel_group()` or `get_model_parallel_group()`), a meshspeed
Topology (`engine.mesh`, anything with `group("tp")`), or None (keep the group an
earlier call set; none at first: no model parallelism).

Note [a process-wide setting]
meshspeed passes groups to what needs them rather than keeping them in globals; this is
the one place that cannot: DeepSpeed scripts call `deepspeed.checkpointing.checkpoint`
from inside model code that never sees the engine. The setting is one frozen
`CheckpointPolicy`, replaced whole by each configure, and `checkpoint_with(policy, ...)`
takes it explicitly for code that can pass it.

Note [initialize applies the config block]
DeepSpeed parses the block in `deepspeed.initialize` and does nothing with it unless
the script calls `configure()`. meshspeed's initialize applies it, with the run's tp
group, when the block sets any key (`configure_from_config`), so a config alone turns
partitioning on. An explicit `configure()` call, before or after initialize, always
wins: initialize then leaves the setting alone (it warns when that setting partitions
without a group while the run has tp > 1). A later initialize re-applies its own block
over an earlier initialize's.

Note [contiguous_memory_optimization and number_checkpoints]
DeepSpeed copies partitioned inputs into one preallocated buffer of number_checkpoints
slots to avoid fragmenting GPU memory. Both keys are accepted and checked (configure()
refuses contiguous without partition_activations or number_checkpoints, as DeepSpeed
does) but change nothing: every kept slice of one block has the same size, so PyTorch's
caching allocator hands the freed block of one step to the same slice in the next; and
a CPU run has no device memory to defragment. `meshspeed.config.no_effect` reports them.

Note [the rule errors are assertions too]
DeepSpeed states the two contiguous rules as `assert`s, so scripts and tests written for
it catch AssertionError; meshspeed's error for them, CheckpointingRuleError, is a
ConfigError (a ValueError, like every config error here) and an AssertionError, so
either `except` catches it.
"""

from __future__ import annotations

import logging
from typing import Any

from meshspeed import comm
from meshspeed.config import ConfigError, MeshspeedConfig
from meshspeed.config.activation import ActivationCheckpointingConfig
from meshspeed.config.keys import check_keys
from meshspeed.config.loader import _read as read_config_source
from meshspeed.config.no_effect import NO_EFFECT
from meshspeed.parallel import rng_tracker
from meshspeed.parallel.activation_checkpoint import CheckpointPolicy, current_policy, set_policy

log = logging.getLogger("meshspeed")

_BLOCK = "activation_checkpointing"
# configure() argument -> config field
_ARGUMENTS = {
    "partition_activations": "partition_activations",
    "contiguous_checkpointing": "contiguous_memory_optimization",
    "num_checkpoints": "number_checkpoints",
    "checkpoint_in_cpu": "cpu_checkpointing",
    "synchronize": "synchronize_checkpoint_boundary",
    "profile": "profile",
}


class CheckpointingRuleError(ConfigError, AssertionError):
    """A combination of activation-checkpointing settings DeepSpeed refuses (Note [the rule
    errors are assertions too])."""


class _Setting:
    """What the last configure left: where it came from, the block, the tp group and the
    mpu object it came from (None when given none, or a Topology)."""

    source: str | None = None  # None: never configured; "configure" or "config"
    block = ActivationCheckpointingConfig()
    group: Any = None
    mpu: Any = None


_setting = _Setting()


def configure(mpu_: Any = None, deepspeed_config: Any = None, partition_activations: bool | None = None,
              contiguous_checkpointing: bool | None = None, num_checkpoints: int | None = None,
              checkpoint_in_cpu: bool | None = None, synchronize: bool | None = None,
              profile: bool | None = None) -> None:
    """Set how `checkpoint()` keeps inputs (module docstring). `deepspeed_config` is a path
    to a JSON config, a dict or a MeshspeedConfig; an argument left None keeps the
    config's value (or the default)."""
    given = {"partition_activations": partition_activations,
             "contiguous_checkpointing": contiguous_checkpointing, "num_checkpoints": num_checkpoints,
             "checkpoint_in_cpu": checkpoint_in_cpu, "synchronize": synchronize, "profile": profile}
    values = _block_of(deepspeed_config).model_dump()
    for name, value in given.items():
        if value is not None:
            values[_ARGUMENTS[name]] = _checked_argument(name, value)
    block = ActivationCheckpointingConfig.checked(values, prefix=_BLOCK)
    _check_rules(block)
    group = _setting.group if mpu_ is None else tp_group_of(mpu_)
    if mpu_ is not None:
        _setting.mpu = mpu_
    _apply(block, group, source="configure")
    if block.contiguous_memory_optimization and _rank() == 0:
        log.info("%s.contiguous_memory_optimization has no effect: %s", _BLOCK,
                 NO_EFFECT[f"{_BLOCK}.contiguous_memory_optimization"])


def _check_rules(block: ActivationCheckpointingConfig) -> None:
    if block.contiguous_memory_optimization and not block.partition_activations:
        raise CheckpointingRuleError(f"{_BLOCK}.contiguous_memory_optimization needs partition_activations "
                                     "(DeepSpeed's rule); set partition_activations=True or drop contiguous")
    if block.contiguous_memory_optimization and block.number_checkpoints is None:
        raise CheckpointingRuleError(f"{_BLOCK}.contiguous_memory_optimization needs number_checkpoints, the "
                                     "number of layers checkpointed per step (DeepSpeed's rule); pass "
                                     "num_checkpoints=<checkpoints per step>")


def current_block() -> ActivationCheckpointingConfig:
    """The settings in force, as a config block (the defaults before any configure)."""
    return _setting.block


def current_mpu() -> Any:
    """The mpu (or Topology) the last configure that passed one was given; None if none."""
    return _setting.mpu


def update(configured: bool | None = None, mpu: Any = None, clear_mpu: bool = False, **fields: Any) -> None:
    """Change some settings and keep the others: `fields` are the config block's keys
    (`partition_activations=True`, `number_checkpoints=None`, ...); `mpu` replaces the
    model-parallel group (`clear_mpu` drops it); `configured=False` goes back to never
    configured (the defaults stay with what `fields` gives). For DeepSpeed scripts that
    assign the checkpointing module's globals."""
    unknown = sorted(set(fields) - set(ActivationCheckpointingConfig.model_fields))
    if unknown:
        raise ConfigError(f"{_BLOCK}: unknown key(s) {', '.join(unknown)}; the keys are "
                          f"{', '.join(sorted(ActivationCheckpointingConfig.model_fields))}")
    block = ActivationCheckpointingConfig.checked({**_setting.block.model_dump(), **fields}, prefix=_BLOCK)
    group = _setting.group
    if clear_mpu:
        group, _setting.mpu = None, None
    elif mpu is not None:
        group, _setting.mpu = tp_group_of(mpu), mpu
    source = _setting.source or "configure"
    if configured is False:
        source = None
    _apply(block, group, source=source, quiet=True)


def configure_from_config(cfg: MeshspeedConfig, topology: Any) -> bool:
    """Called by `meshspeed.initialize`: apply the config's block with the run's tp group
    when it sets any key and no explicit configure() came first (Note [initialize applies
    the config block]). Returns whether it applied."""
    block = cfg.activation_checkpointing
    if not block.model_fields_set:
        return False
    if _setting.source == "configure":
        policy = current_policy()
        if policy.partition and policy.size == 1 and topology.size("tp") > 1 and _rank() == 0:
            log.warning("activation checkpointing: configure() set partition_activations without "
                        "a tensor-parallel group, so inputs are kept whole; pass the group with "
                        "deepspeed.checkpointing.configure(engine.mesh, ...) after initialize")
        return False
    _apply(block, topology.group("tp"), source="config")
    return True


def is_configured() -> bool:
    """Whether configure() ran (or initialize applied a config block)."""
    return _setting.source is not None


def reset() -> None:
    """DeepSpeed frees its contiguous buffers here (for evaluation loops that run forward
    without backward). meshspeed has none: kept inputs belong to the autograd graph and
    go with it. Kept for scripts that call it; the configuration stays."""


def set_num_layers(nlayers: int) -> None:
    """DeepSpeed's setter for number_checkpoints (which has no effect here)."""
    count = _checked_argument("num_checkpoints", nlayers)
    _apply(_setting.block.model_copy(update={"number_checkpoints": count}), _setting.group,
           source=_setting.source or "configure")


def partition_activations_in_checkpoint(partition_activation: bool) -> None:
    """DeepSpeed's setter for partition_activations alone."""
    flag = _checked_argument("partition_activations", partition_activation)
    _apply(_setting.block.model_copy(update={"partition_activations": flag}), _setting.group,
           source=_setting.source or "configure")


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Seed the default generator with `seed` and the tracker's "model-parallel-rng" state
    with `seed + 2718 + tp rank` (Megatron's convention), the tp rank being this rank's in
    the configured group (0 without one). Call it after configure() or initialize."""
    rng_tracker.seed_model_parallel(seed, current_policy().rank)


def tp_group_of(mpu: Any) -> Any:
    """The tensor-parallel group of a Megatron-style mpu or a meshspeed Topology."""
    for getter in ("get_tensor_model_parallel_group", "get_model_parallel_group"):
        fn = getattr(mpu, getter, None)
        if callable(fn):
            return fn()
    group = getattr(mpu, "group", None)
    if callable(group):
        return group("tp")
    raise TypeError(f"configure(mpu_=...): {type(mpu).__name__} has neither "
                    "get_model_parallel_group() (a Megatron-style mpu) nor group('tp') (a meshspeed "
                    "Topology such as engine.mesh); pass one of those, or None for no model parallelism")


def _apply(block: ActivationCheckpointingConfig, group: Any, source: str | None, quiet: bool = False) -> None:
    rank, size = (comm.get_rank(group), comm.get_world_size(group)) if group is not None else (0, 1)
    _setting.source, _setting.block, _setting.group = source, block, group
    set_policy(CheckpointPolicy(partition=block.partition_activations, cpu=block.cpu_checkpointing,
                                synchronize=block.synchronize_checkpoint_boundary, profile=block.profile,
                                group=group, rank=rank, size=size))
    if not quiet and _rank() == 0:
        log.info("activation checkpointing (%s): partition_activations=%s (tp size %d), "
                 "cpu_checkpointing=%s, synchronize=%s, profile=%s", source, block.partition_activations,
                 size, block.cpu_checkpointing, block.synchronize_checkpoint_boundary, block.profile)


def _block_of(source: Any) -> ActivationCheckpointingConfig:
    """The `activation_checkpointing` block of a config path, dict or MeshspeedConfig;
    only that block is read and checked (the rest belongs to initialize)."""
    if source is None:
        return ActivationCheckpointingConfig()
    if isinstance(source, MeshspeedConfig):
        return source.activation_checkpointing
    raw = read_config_source(source)  # the loader's reader: same errors for a bad path or JSON
    if _BLOCK not in raw:
        return ActivationCheckpointingConfig()
    checked = check_keys({_BLOCK: raw[_BLOCK]}, MeshspeedConfig)  # typos named with a suggestion
    if checked.problems:
        raise ConfigError(checked.problems)
    block = checked.data[_BLOCK]
    if not isinstance(block, dict):
        raise ConfigError(f"{_BLOCK}: expected an object ({{...}}), got {type(block).__name__}")
    return ActivationCheckpointingConfig.checked(block, prefix=_BLOCK)


def _checked_argument(name: str, value: Any) -> Any:
    if name == "num_checkpoints":
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"configure({name}=...): expected a positive integer, got {value!r}")
    elif not isinstance(value, bool):
        raise ConfigError(f"configure({name}=...): expected True or False, got {value!r}")
    return value


def _rank() -> int:
    return comm.get_rank() if comm.is_initialized() else 0


def _clear() -> None:
    """Back to never configured (for tests)."""
    _setting.source, _setting.block, _setting.group = None, ActivationCheckpointingConfig(), None
    _setting.mpu = None
    set_policy(CheckpointPolicy())
