"""DeepSpeed's `deepspeed.runtime.activation_checkpointing.checkpointing`: the names of
`meshspeed.checkpointing` (see there)."""

# this module is an alias of that one: every public name, and the same objects
from meshspeed.compat.deepspeed.checkpointing import *
from meshspeed.compat.deepspeed.checkpointing import __all__  # noqa: F401
