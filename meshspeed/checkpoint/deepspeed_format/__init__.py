"""DeepSpeed's checkpoint layout: reading it (import) and writing it (export).

Nothing here imports DeepSpeed; its files are read with an allowlisting unpickler
(unpickle.py) and written with DeepSpeed's record classes named, never imported
(picklewriter.py)."""

from meshspeed.checkpoint.deepspeed_format.unpickle import DeepSpeedRecord, load_torch_file
from meshspeed.checkpoint.deepspeed_format.write import export

__all__ = ["DeepSpeedRecord", "export", "load_torch_file"]
