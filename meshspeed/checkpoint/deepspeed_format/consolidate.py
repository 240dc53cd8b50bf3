"""A DeepSpeed checkpoint's whole weights in one safetensors file (`meshspeed convert`).

What DeepSpeed's zero_to_fp32.py gives: the fp32 masters where the checkpoint has them
(ZeRO partitions, bf16/fp16 flat groups), else the saved weights, plus the buffers, under
`named_parameters()` / state_dict names (a tied parameter under each of its names). One
parameter is held at a time: the header is written from the DeepSpeed headers first.
"""

from __future__ import annotations

import torch

from meshspeed.checkpoint.deepspeed_format.discover import TagFiles
from meshspeed.checkpoint.deepspeed_format.kinds import open_tag
from meshspeed.checkpoint.tensorfile import Spec, TensorFileWriter


def _plan(ckpt, dtype: torch.dtype) -> list[tuple[Spec, str]]:
    aliases_of: dict[str, list[str]] = {}
    for alias, name in ckpt.aliases.items():
        aliases_of.setdefault(name, []).append(alias)
    plan = []
    for name in ckpt.all_param_names():
        for out in [name, *aliases_of.get(name, [])]:
            plan.append((Spec(out, dtype, ckpt.shapes[name]), name))
    for name, b in ckpt.buffers.items():
        plan.append((Spec(name, dtype if b.dtype.is_floating_point else b.dtype, tuple(b.shape)), name))
    return plan


def deepspeed_state_dict(files: TagFiles, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    ckpt = open_tag(files)
    out = {}
    masters = {p.name: p.master for p in ckpt.params()}
    for spec, source in _plan(ckpt, dtype):
        t = masters.get(source, ckpt.buffers.get(source))
        out[spec.name] = t.to(spec.dtype)
    return out


def convert_deepspeed(files: TagFiles, out_path: str, dtype: torch.dtype = torch.float32) -> dict:
    """Stream the DeepSpeed tag's whole weights into `out_path`; a summary like convert()'s."""
    ckpt = open_tag(files)
    plan = _plan(ckpt, dtype)
    by_source: dict[str, list[Spec]] = {}
    for spec, source in plan:
        by_source.setdefault(source, []).append(spec)
    # writes follow the plan's order: parameters in params() order, then buffers
    with TensorFileWriter(str(out_path), [spec for spec, _ in plan], metadata={"format": "pt"}) as w:
        for p in ckpt.params():
            t = p.master.to(dtype)
            for spec in by_source[p.name]:
                w.write(spec.name, t)
            del t, p
        for name, b in ckpt.buffers.items():
            for spec in by_source[name]:
                w.write(spec.name, b.to(spec.dtype))
    return {"source": files.path, "output": str(out_path), "tensors": len(plan), "bytes": w.nbytes}
