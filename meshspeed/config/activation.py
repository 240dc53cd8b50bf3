"""The `activation_checkpointing` section.

Owned by `meshspeed/parallel/activation_checkpoint.py`.
"""

from __future__ import annotations

from meshspeed.config.base import PositiveInt, StrictModel


class ActivationCheckpointingConfig(StrictModel):
    """Recompute activations in backward instead of storing them."""

    partition_activations: bool = False  # shard saved inputs across tensor-parallel ranks
    cpu_checkpointing: bool = False  # move saved inputs to CPU
    contiguous_memory_optimization: bool = False  # copy saved inputs into one buffer
    number_checkpoints: PositiveInt | None = None  # size of that buffer, in checkpoints
    synchronize_checkpoint_boundary: bool = False  # device sync at each boundary
    profile: bool = False  # log forward/backward time per checkpointed function
