"""DeepSpeed's `deepspeed.runtime.activation_checkpointing` package path."""

from meshspeed.compat.deepspeed.runtime.activation_checkpointing import checkpointing

__all__ = ["checkpointing"]
