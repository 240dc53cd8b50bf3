"""meshspeed's version, and the DeepSpeed version the drop-in answers as.

`DEEPSPEED_VERSION` is what `deepspeed.__version__` (and, once installed as the alias,
the package metadata) reports: the DeepSpeed release whose behaviour meshspeed matches,
so version checks in transformers and accelerate pass, with meshspeed's own version as
the PEP 440 local label, so it still says what it is.
"""

__version__ = "0.1.0"
DEEPSPEED_MATCHED = "0.19.8"
DEEPSPEED_VERSION = f"{DEEPSPEED_MATCHED}+meshspeed.{__version__}"
