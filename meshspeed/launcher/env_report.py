"""`meshspeed env`: one screen on what this installation can do (DeepSpeed's ds_report).

Reports versions and install paths, the accelerator, the distributed backends torch was
built with, precision and pinned-memory support, required and optional packages, and the
host features NVMe offload relies on. Nothing here starts a process group or needs a GPU.
"""

from __future__ import annotations

import argparse
import ctypes.util
import importlib.metadata
import importlib.util
import json
import os
import platform
import sys
from typing import Any

import torch
import torch.distributed as dist

import meshspeed
from meshspeed.process.accelerator import get_accelerator

REQUIRED = ("safetensors", "pydantic", "numpy", "tqdm")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def main(args: argparse.Namespace) -> int:
    report = collect()
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def collect() -> dict[str, dict[str, Any]]:
    """The report as ``{section: {item: value}}``; values are JSON-serialisable."""
    accelerator = get_accelerator()
    cuda = torch.cuda.is_available()
    return {
        "meshspeed": {
            "version": meshspeed.__version__,
            "install path": os.path.dirname(meshspeed.__file__),
        },
        "python": {
            "version": platform.python_version(),
            "executable": sys.executable,
            "platform": platform.platform(),
        },
        "torch": {
            "version": torch.__version__,
            "install path": os.path.dirname(torch.__file__),
            "CUDA build": torch.version.cuda,
            "CUDA available": cuda,
            "devices": [_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
        },
        "accelerator": {
            "name": accelerator.name,
            "default backend": accelerator.default_backend(),
            "bf16": accelerator.supports_bf16(),
            "pinned memory": accelerator.is_pin_available(),
        },
        "distributed backends": {
            "gloo": dist.is_available() and dist.is_gloo_available(),
            "nccl": dist.is_available() and dist.is_nccl_available(),
            "mpi": dist.is_available() and dist.is_mpi_available(),
        },
        "packages": {name: _version(name) for name in REQUIRED},
        "optional": {
            "matplotlib (plots)": _version("matplotlib"),
            "deepspeed (for comparisons)": _version("deepspeed"),
            "hypothesis (tests)": _version("hypothesis"),
        },
        "NVMe offload": {
            "O_DIRECT": hasattr(os, "O_DIRECT"),
            "liburing": ctypes.util.find_library("uring") is not None,
        },
        "threads": {
            "cpu count": os.cpu_count(),
            "usable cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else os.cpu_count(),
            "torch threads": torch.get_num_threads(),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        },
    }


def format_report(report: dict[str, dict[str, Any]]) -> str:
    width = max(len(item) for section in report.values() for item in section) + 2
    lines = []
    for title, section in report.items():
        lines.append(f"[{title}]")
        for item, value in section.items():
            lines.append(f"  {item + ' ':.<{width}} {_show(value)}")
    return "\n".join(lines)


def _show(value: Any) -> str:
    if value is True:
        return "yes"
    if value is False:
        return "no"
    if value is None:
        return "-"
    if isinstance(value, list):
        return ", ".join(map(str, value)) or "none"
    return str(value)


def _version(package: str) -> str:
    """Installed version; reads metadata only, so nothing heavy is imported."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "present (no metadata)" if importlib.util.find_spec(package) else "not installed"


def _device_name(index: int) -> str:
    major, minor = torch.cuda.get_device_capability(index)
    return f"{torch.cuda.get_device_name(index)} (sm_{major}{minor})"
