"""DeepSpeed's checkpoint layout: writing it from a meshspeed checkpoint (export)."""

from meshspeed.checkpoint.deepspeed_format.write import export

__all__ = ["export"]
