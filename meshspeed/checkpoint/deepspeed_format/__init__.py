"""DeepSpeed's checkpoint layout: reading it (import) and writing it (export).

Nothing here imports DeepSpeed; its files are read with an allowlisting unpickler
(unpickle.py)."""

from meshspeed.checkpoint.deepspeed_format.unpickle import DeepSpeedRecord, load_torch_file

__all__ = ["DeepSpeedRecord", "load_torch_file"]
