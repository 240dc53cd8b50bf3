"""Which layers each pipeline stage owns: DeepSpeed's `partition_method`s, as pure functions.

    bounds = partition(layers, stages=4, method="parameters")   # [0, 3, 6, 9, 12]
    stage s owns layers[bounds[s] : bounds[s + 1]]

Each layer gets a weight and the layers are cut into `stages` contiguous runs:
  "parameters"    the layer's parameter count, counted on the meta device for a LayerSpec,
                  so no stage builds a layer it does not own;
  "uniform"       1 per layer: equal numbers of layers;
  "type:<regex>"  1 per layer whose class name matches the regex (case-insensitive),
                  0 for the rest: e.g. "type:transformer" balances the blocks and leaves the
                  embedding and head wherever the cuts fall.

Note [balanced contiguous cuts]
The cut minimises the heaviest stage (the pipeline's slowest stage sets its pace). A layer
of weight 0 cannot make a stage heavier, so among the cuts with the same heaviest stage
the one that gives every stage at least one weighted layer is taken. When no such cut
exists (fewer weighted layers than stages) that is an error, not an empty stage. Between
equally good cuts the later stages take the extra layers: under 1F1B the first stages
hold the most micro-batches in flight. Exact dynamic programming over prefix sums:
O(stages x layers^2) for a few hundred layers.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from meshspeed.parallel.pipeline.spec import LayerSpec


class PartitionError(ValueError):
    """The layers cannot be split as asked (too many stages, an unknown method)."""


def layer_weights(layers: Sequence[Any], method: str) -> list[int]:
    """The weight of each layer under `method` (see the module docstring)."""
    name = method.lower()
    if name == "uniform":
        return [1] * len(layers)
    if name == "parameters":
        return [_param_count(layer) for layer in layers]
    if name.startswith("type:"):
        pattern = re.compile(method[len("type:"):], re.IGNORECASE)
        return [1 if pattern.search(_class_name(layer)) else 0 for layer in layers]
    raise PartitionError(f"partition_method {method!r} is not one of \"parameters\", \"uniform\" "
                         "or \"type:<regex>\"")


def partition(layers: Sequence[Any], stages: int, method: str = "parameters") -> list[int]:
    """Stage boundaries: stage s owns layers[bounds[s]:bounds[s + 1]]."""
    if stages < 1:
        raise PartitionError(f"num_stages must be at least 1, got {stages}")
    if stages > len(layers):
        raise PartitionError(f"{stages} pipeline stages for {len(layers)} layers: each stage needs at "
                             f"least one layer; use at most {len(layers)} stages")
    weights = layer_weights(layers, method)
    if method.lower() == "parameters" and sum(weights) == 0:
        weights = [1] * len(layers)  # no parameters anywhere: balance the layers instead
    counted = sum(w > 0 for w in weights)
    if counted < stages:
        raise PartitionError(f"partition_method {method!r} weighs {counted} of the {len(layers)} layers, "
                             f"fewer than the {stages} stages: a stage would own none; use fewer "
                             "stages or another partition_method")
    return balanced_cuts(weights, stages)


def balanced_cuts(weights: Sequence[int], stages: int) -> list[int]:
    """Contiguous cuts of `weights` into `stages` runs, each with a weighted layer, that
    minimise the heaviest run (Note [balanced contiguous cuts])."""
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    weighted = [0]
    for w in weights:
        weighted.append(weighted[-1] + (w > 0))
    inf = float("inf")
    # best[k][i]: the lightest heaviest run cutting the first i layers into k runs
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for i in range(1, n + 1):
            for j in range(k - 1, i):
                if best[k - 1][j] == inf or weighted[i] == weighted[j]:
                    continue  # a run without a weighted layer
                heaviest = max(best[k - 1][j], prefix[i] - prefix[j])
                if heaviest < best[k][i]:
                    best[k][i], cut[k][i] = heaviest, j
    if best[stages][n] == inf:
        raise PartitionError(f"no cut of {n} layers into {stages} stages gives every stage a weighted layer")
    bounds = [n]
    for k in range(stages, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return bounds[::-1]


def _class_name(layer: Any) -> str:
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    return type(layer).__name__ if isinstance(layer, nn.Module) else getattr(layer, "__name__", "")


def _param_count(layer: Any) -> int:
    if isinstance(layer, LayerSpec):
        with torch.device("meta"):  # counted without memory: only the owner stage builds it
            layer = layer.build()
    if isinstance(layer, nn.Module):
        return sum(p.numel() for p in layer.parameters())
    return 0
