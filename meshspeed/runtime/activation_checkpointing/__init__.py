"""DeepSpeed's `deepspeed.runtime.activation_checkpointing` package path."""

from meshspeed.runtime.activation_checkpointing import checkpointing

__all__ = ["checkpointing"]
