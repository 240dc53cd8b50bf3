"""Inference: `init_inference`, generation with a KV cache, continuous batching, weight-only
quantization, fused kernels and ZeRO-Inference (issue 16). docs/inference.md.

Names are imported on first use, so `import meshspeed.inference` stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "init_inference": "meshspeed.inference.engine",
    "InferenceEngine": "meshspeed.inference.engine",
    "InferenceConfig": "meshspeed.inference.config",
    "DeepSpeedInferenceConfig": "meshspeed.inference.config",
    "generate": "meshspeed.inference.generation",
    "runner_for": "meshspeed.inference.runners",
    "Server": "meshspeed.inference.server",
    "Request": "meshspeed.inference.server",
    "SamplingParams": "meshspeed.inference.sampling",
    "quantize_weights": "meshspeed.inference.quant",
    "partition_for_inference": "meshspeed.inference.zero_inference",
}

__all__ = sorted(_LAZY)  # noqa: PLE0605


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'meshspeed.inference' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
