"""What `MeshspeedEngine` delegates to: the engine's checkpoint methods, engine first."""

from meshspeed.checkpoint.export import consolidated_state_dict, save_16bit_model
from meshspeed.checkpoint.load import load_checkpoint
from meshspeed.checkpoint.pending import raise_pending_errors, wait_for_pending
from meshspeed.checkpoint.save import save_checkpoint

__all__ = ["consolidated_state_dict", "load_checkpoint", "raise_pending_errors", "save_16bit_model",
           "save_checkpoint", "wait_for_pending"]
