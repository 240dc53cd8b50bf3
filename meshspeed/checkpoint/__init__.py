"""Sharded checkpoints: every rank saves what it owns; any layout loads them.

    engine.save_checkpoint(save_dir)                # <save_dir>/global_step<N>/, then `latest`
    engine.load_checkpoint(save_dir)                # any data-parallel size, any ZeRO stage
    state = meshspeed.checkpoint.consolidate(save_dir)   # full state dict, no processes
    $ meshspeed convert save_dir model.safetensors --dtype bf16

Tensors are in safetensors files and everything else in JSON: nothing is ever unpickled.
The format and its guarantees are described in docs/checkpoints.md; the layout of a
checkpoint directory in paths.py; resharding in Note [resharding is range intersection]
(reshard.py); crash safety in Note [publishing a checkpoint] (writer.py).
"""

from meshspeed.checkpoint.consolidate import consolidate, convert
from meshspeed.checkpoint.errors import CheckpointError
from meshspeed.checkpoint.metadata import read_meta
from meshspeed.checkpoint.paths import resolve

__all__ = ["CheckpointError", "consolidate", "convert", "read_meta", "resolve"]
