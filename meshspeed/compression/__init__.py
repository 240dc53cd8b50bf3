"""Compression training with DeepSpeed's API: quantization, pruning and layer reduction.

`compress.init_compression(model, config)` wraps the layers the config's
`compression_training` block names; the engine (or a `scheduler.compression_scheduler`)
starts each technique at its schedule_offset; `compress.redundancy_clean(model, config)`
writes the result into plain, smaller layers. See docs/compression.md.
"""

from meshspeed.compression.compress import init_compression, redundancy_clean
from meshspeed.compression.helper import (
    convert_conv1d_to_linear,
    recursive_getattr,
    recursive_setattr,
)
from meshspeed.compression.scheduler import compression_scheduler

__all__ = [
    "compression_scheduler",
    "convert_conv1d_to_linear",
    "init_compression",
    "recursive_getattr",
    "recursive_setattr",
    "redundancy_clean",
]
