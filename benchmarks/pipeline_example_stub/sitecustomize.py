"""Run by every Python process started with this directory on PYTHONPATH
(benchmarks/pipeline_example.py), before the example script: the CPU adaptation and the
measurement of an unchanged DeepSpeedExamples pipeline script, for either framework.

1. CPU: the script calls `torch.cuda.set_device(local_rank)` unconditionally; a CPU build
   of torch raises there (AttributeError: module 'torch._C' has no attribute
   '_cuda_setDevice'). Without CUDA it becomes a no-op that accepts the same argument.
2. Measurement, when PIPE_EXAMPLE_RECORD names a directory: `train_batch` of the pipeline
   engine class (DeepSpeed's deepspeed.runtime.pipe.engine.PipelineEngine or meshspeed's
   meshspeed.engine.pipeline.PipelineEngine, whichever the script imports) is wrapped, as
   that module is imported, to note each call's returned loss (the script drops it) and
   its wall time. At exit each rank writes rank<R>.json there: the losses, the seconds,
   its stage and the stage boundaries (`module.parts`), its parameter count. Nothing else
   in either framework is touched.
"""

import atexit
import importlib.abc
import importlib.machinery
import json
import os
import sys
import time

import torch

if not torch.cuda.is_available():
    def _set_device(device):  # torch.cuda.set_device on a machine without CUDA
        del device

    torch.cuda.set_device = _set_device

_ENGINES = {"deepspeed.runtime.pipe.engine": "PipelineEngine",
            "meshspeed.engine.pipeline": "PipelineEngine"}
_RECORD = {"losses": [], "seconds": [], "framework": None}


def _wrap(module, cls_name: str) -> None:
    cls = getattr(module, cls_name)
    original = cls.train_batch

    def train_batch(self, *args, **kwargs):
        if _RECORD["framework"] is None:
            _RECORD.update(framework=module.__name__.split(".")[0], stage=int(self.stage_id),
                           first=bool(self.is_first_stage()), last=bool(self.is_last_stage()),
                           parts=[int(p) for p in getattr(self.module, "parts", [])],
                           params=sum(p.numel() for p in self.module.parameters()))
        start = time.perf_counter()
        loss = original(self, *args, **kwargs)
        _RECORD["seconds"].append(time.perf_counter() - start)
        _RECORD["losses"].append(float(loss))
        return loss

    cls.train_batch = train_batch


class _Loader(importlib.abc.Loader):
    def __init__(self, inner, cls_name):
        self.inner, self.cls_name = inner, cls_name

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        _wrap(module, self.cls_name)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _ENGINES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _Loader(spec.loader, _ENGINES[fullname])
        return spec


def _write() -> None:
    if _RECORD["framework"] is None:
        return
    out = os.path.join(os.environ["PIPE_EXAMPLE_RECORD"], f"rank{os.environ.get('RANK', '0')}.json")
    with open(out, "w") as f:
        json.dump(_RECORD, f)


if os.environ.get("PIPE_EXAMPLE_RECORD"):
    sys.meta_path.insert(0, _Finder())
    atexit.register(_write)
