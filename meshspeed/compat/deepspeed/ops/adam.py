"""`from deepspeed.ops.adam import FusedAdam, DeepSpeedCPUAdam`; see meshspeed.optim.adam."""

from meshspeed.optim.adam import DeepSpeedCPUAdam, FusedAdam

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]
