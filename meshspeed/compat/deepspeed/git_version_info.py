"""`deepspeed.git_version_info`: what was installed, in DeepSpeed's names.

`version` is the DeepSpeed release meshspeed matches with meshspeed's own version as its
local label (meshspeed.version.DEEPSPEED_VERSION); `installed_ops` / `compatible_ops` come
from the op builders (Note [builders tell the truth]); `torch_info` is the running torch,
with "0.0" for what this build lacks, the value DeepSpeed's readers take for "unknown".
"""

from __future__ import annotations

import torch

from meshspeed.compat.deepspeed.ops.op_builder import compatible_ops as _compatible_ops
from meshspeed.version import DEEPSPEED_VERSION, __version__

version = DEEPSPEED_VERSION
git_hash = f"meshspeed-{__version__}"
git_branch = "meshspeed"
compatible_ops = _compatible_ops()
installed_ops = dict(compatible_ops)  # nothing is compiled; what exists is importable
accelerator_name = "cuda" if torch.cuda.is_available() else "cpu"


def _major_minor(text: str | None) -> str:
    return ".".join((text or "0.0").split("+")[0].split(".")[:2])


def _nccl() -> str:
    try:
        return ".".join(map(str, torch.cuda.nccl.version()[:2])) if torch.cuda.is_available() else "0.0"
    except (AttributeError, RuntimeError):
        return "0.0"


torch_info = {"version": _major_minor(torch.__version__), "bf16_support": True,
              "cuda_version": _major_minor(torch.version.cuda), "nccl_version": _nccl(),
              "hip_version": _major_minor(getattr(torch.version, "hip", None))}

__all__ = ["accelerator_name", "compatible_ops", "git_branch", "git_hash", "installed_ops", "torch_info", "version"]
