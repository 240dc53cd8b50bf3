"""`meshspeed.checkpointing` / `deepspeed.checkpointing`: DeepSpeed's activation checkpointing
API. In DeepSpeed this name is the module `deepspeed.runtime.activation_checkpointing
.checkpointing` itself, and so it is here: importing this module gives that one (see
there), so its settings and globals are one and the same whichever name a script used."""

import sys

from meshspeed.compat.deepspeed.runtime.activation_checkpointing import checkpointing as _long_path

sys.modules[__name__] = _long_path
