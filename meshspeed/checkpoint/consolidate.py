"""One full state dict from a sharded checkpoint, in memory or streamed to a file.

No process group is needed. `convert` holds one parameter at a time: the output header
is written first (shapes and dtypes are in meta.json), then each parameter is assembled
from the saved ranges, converted, written and dropped, so the extra memory stays near the
largest parameter (in fp32, plus its converted copy) however large the model is. A
tensor-parallel checkpoint gives logical (whole) tensors: each is assembled from every tp
rank's pieces (Note [tensor-parallel ranges] in tp_ranges.py), in bounded reads.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterator

import torch

from meshspeed.checkpoint.deepspeed_format.consolidate import (
    convert_deepspeed,
    deepspeed_state_dict,
)
from meshspeed.checkpoint.deepspeed_format.discover import find_tag
from meshspeed.checkpoint.metadata import dtype_from_name, read_meta
from meshspeed.checkpoint.paths import resolve
from meshspeed.checkpoint.reshard import SavedTensors, verify_files
from meshspeed.checkpoint.tensorfile import Spec, TensorFileWriter
from meshspeed.process.malloc import tune_host_allocator
from meshspeed.process.progress import progress

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _open(ckpt_dir, tag, verify: bool) -> SavedTensors:
    path = resolve(ckpt_dir, tag)
    meta = read_meta(path)
    if verify:
        verify_files(path, meta)
    return SavedTensors(path, meta)


def _plan(meta: dict, dtype: torch.dtype) -> list[tuple[Spec, str, str]]:
    """(output spec, source name, "param" | "buffer") in file order; aliases follow their param."""
    aliases_of = defaultdict(list)
    for alias, name in meta["aliases"].items():
        aliases_of[name].append(alias)
    plan = []
    for name, p in meta["params"].items():
        for out in [name, *aliases_of[name]]:
            plan.append((Spec(out, dtype, tuple(p["shape"])), name, "param"))
    for name, b in meta["buffers"].items():
        saved = dtype_from_name(b["dtype"])
        plan.append((Spec(name, dtype if saved.is_floating_point else saved, tuple(b["shape"])),
                     name, "buffer"))
    return plan


def _tensors(store: SavedTensors, plan, dtype) -> Iterator[tuple[Spec, torch.Tensor]]:
    rank0 = next(r["file"] for r in store.meta["ranks"] if r["rank"] == 0)
    last = (None, None)  # an alias reuses the tensor just produced for its parameter
    for spec, source, kind in plan:
        if last[0] == source:
            yield spec, last[1]
            continue
        last = t = None  # drop the previous tensor before assembling the next
        if kind == "param":
            t = torch.empty(spec.shape, dtype=torch.float32)
            store.fill(source, "master", 0, math.prod(spec.shape), t)
        else:
            t = store.read(rank0, f"buffer/{source}")
        t = t.to(spec.dtype)
        last = (source, t)
        yield spec, t


def consolidate(ckpt_dir, tag: str | None = None, dtype: torch.dtype = torch.float32,
                verify: bool = True) -> dict[str, torch.Tensor]:
    """Full parameters (fp32 masters cast to `dtype`) and persistent buffers by state_dict name.

    `ckpt_dir` is a save_dir (tag None: its `latest`) or a tag directory. Tied parameters
    appear under every name, as the same tensor. A DeepSpeed checkpoint directory (or tag)
    gives its fp32 masters, as DeepSpeed's zero_to_fp32.py does."""
    deepspeed_tag = find_tag(ckpt_dir, tag)
    if deepspeed_tag is not None:
        return deepspeed_state_dict(deepspeed_tag, dtype)
    store = _open(ckpt_dir, tag, verify)
    return {spec.name: t for spec, t in _tensors(store, _plan(store.meta, dtype), dtype)}


def convert(ckpt_dir, out_path: str, tag: str | None = None, dtype: torch.dtype = torch.float32,
            verify: bool = True) -> dict:
    """Stream the consolidated state dict into one safetensors file. Returns a summary."""
    # parameter-sized buffers come and go one after another: with glibc's sliding mmap
    # threshold they would stay in the heap (Note [a fixed mmap threshold for CPU training])
    tune_host_allocator()
    deepspeed_tag = find_tag(ckpt_dir, tag)
    if deepspeed_tag is not None:  # DeepSpeed's layout: what its zero_to_fp32.py writes
        return convert_deepspeed(deepspeed_tag, out_path, dtype)
    store = _open(ckpt_dir, tag, verify)
    plan = _plan(store.meta, dtype)
    with TensorFileWriter(str(out_path), [spec for spec, _, _ in plan], metadata={"format": "pt"}) as w, \
            progress(len(plan), "checkpoint convert", unit="tensor") as bar:
        for spec, t in _tensors(store, plan, dtype):
            bar.update()
            w.write(spec.name, t)
            del t
    return {"source": store.path, "output": str(out_path), "tensors": len(plan), "bytes": w.nbytes}
