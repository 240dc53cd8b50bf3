"""`PipelineModule`: a model written as a list of layers, DeepSpeed's pipeline interface.

    net = PipelineModule(layers=[LayerSpec(nn.Linear, 8, 16), nn.ReLU(), nn.Linear(16, 2)],
                         loss_fn=nn.CrossEntropyLoss(), num_stages=1)

The layers are applied in order, each one's output the next one's input. `LayerSpec`
defers building a layer (with several stages each rank would build only its own);
`TiedLayerSpec` builds one module per key and reuses it wherever the key appears (tied
embeddings).

Note [one pipeline stage only]
Pipeline parallelism itself (splitting the layers over stages, a micro-batch schedule,
point-to-point activations) is not implemented yet. With one stage the module is an
ordinary `nn.Module`: it trains under data parallelism or ZeRO like any model (compute the
loss with `net.loss_fn(output, labels)`). More than one stage raises NotImplementedError
at construction -- running every layer on every rank instead would be data parallelism
under a pipeline's name, with none of its memory savings.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from meshspeed import comm
from meshspeed.topology.process import PipeDataParallelTopology, ProcessTopology

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]


class LayerSpec:
    """A layer to build later: ``LayerSpec(nn.Linear, 8, 16, bias=False).build()``."""

    def __init__(self, typename: type[nn.Module], *module_args: Any, **module_kwargs: Any):
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise TypeError(f"LayerSpec needs an nn.Module class, got {typename!r}")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def build(self, log: bool = False) -> nn.Module:
        del log  # DeepSpeed logs each build; nothing here is worth a line per layer
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        args = [repr(a) for a in self.module_args] + [f"{k}={v!r}" for k, v in self.module_kwargs.items()]
        return f"{type(self).__name__}({self.typename.__name__}, {', '.join(args)})"


class TiedLayerSpec(LayerSpec):
    """A layer shared by every position that names the same `key`.

    `forward_fn(module, x)`, when given, is what that position computes with the shared
    module (e.g. the output projection through a tied embedding's weight).
    `tied_weight_attr` names the tied tensors; with one stage the whole module is shared,
    so they are tied by construction."""

    def __init__(self, key: str, typename: type[nn.Module], *module_args: Any,
                 forward_fn: Callable[[nn.Module, Any], Any] | None = None,
                 tied_weight_attr: str | Sequence[str] = ("weight",), **module_kwargs: Any):
        super().__init__(typename, *module_args, **module_kwargs)
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)


def _stages(num_stages: int | None, topology: ProcessTopology | None) -> int:
    if topology is not None:
        return topology.get_dim("pipe") or 1
    if num_stages is None:
        raise ValueError("PipelineModule needs num_stages=... or topology=...")
    return num_stages


class PipelineModule(nn.Module):
    """DeepSpeed's `PipelineModule` arguments; one stage only (Note [one pipeline stage only])."""

    def __init__(self, layers: Sequence[Any], num_stages: int | None = None,
                 topology: ProcessTopology | None = None, loss_fn: Callable | None = None,
                 seed_layers: bool = False, seed_fn: Callable[[int], Any] | None = None,
                 base_seed: int = 1234, partition_method: str = "parameters",
                 activation_checkpoint_interval: int = 0,
                 activation_checkpoint_func: Callable | None = None,
                 checkpointable_layers: list[str] | None = None, dynamic_shape: bool = False):
        super().__init__()
        stages = _stages(num_stages, topology)
        if stages > 1:
            raise NotImplementedError(
                f"PipelineModule with {stages} stages: pipeline parallelism is not available in "
                "meshspeed yet. Use num_stages=1 to train the layers as one module (data parallel "
                "or ZeRO over every rank), or keep DeepSpeed for pipeline training.")
        if topology is not None and any(d > 1 for a, d in zip(topology.axes, topology.dims)
                                        if a not in ("pipe", "data")):
            raise NotImplementedError(f"PipelineModule topology {topology}: only the 'data' axis may "
                                      "exceed 1 (model parallelism through a topology is not available)")
        world = comm.get_world_size() if comm.is_initialized() else 1
        self._topo = topology or PipeDataParallelTopology(num_pp=1, num_dp=world)
        self.num_stages = 1
        self.stage_id = 0
        self.loss_fn = loss_fn
        self.partition_method = partition_method  # no effect with one stage
        self.dynamic_shape = dynamic_shape
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.activation_checkpoint_func = activation_checkpoint_func
        self.checkpointable_layers = checkpointable_layers
        self.tied_modules = nn.ModuleDict()
        self.forward_funcs: list[Callable] = []
        self._names: list[str | None] = []  # class name per position, for checkpointable_layers
        for index, layer in enumerate(layers):
            if seed_layers:
                (seed_fn or torch.manual_seed)(base_seed + index)
            self.forward_funcs.append(self._place(index, layer))

    def _place(self, index: int, layer: Any) -> Callable:
        """Register `layer` at position `index`; return what forward calls there."""
        if isinstance(layer, TiedLayerSpec):
            if layer.key not in self.tied_modules:
                self.tied_modules[layer.key] = layer.build()
            module = self.tied_modules[layer.key]
            self._names.append(type(module).__name__)
            return functools.partial(layer.forward_fn, module) if layer.forward_fn else module
        if isinstance(layer, LayerSpec):
            layer = layer.build()
        if isinstance(layer, nn.Module):
            self.add_module(str(index), layer)
            self._names.append(type(layer).__name__)
            return layer
        if callable(layer):  # a plain function between layers, e.g. a flatten
            self._names.append(None)
            return layer
        raise TypeError(f"PipelineModule layer {index}: expected an nn.Module, LayerSpec or callable, "
                        f"got {type(layer).__name__}")

    def topology(self) -> ProcessTopology:
        return self._topo

    def forward(self, forward_input: Any) -> Any:
        interval = self.activation_checkpoint_interval
        if interval <= 0 or not (self.training and torch.is_grad_enabled()):
            return _run(self.forward_funcs, forward_input)
        x = forward_input
        for start in range(0, len(self.forward_funcs), interval):
            stop = min(start + interval, len(self.forward_funcs))
            funcs = self.forward_funcs[start:stop]
            if not self._checkpointable(start, stop):
                x = _run(funcs, x)
                continue
            args = x if isinstance(x, tuple) else (x,)
            block = functools.partial(_run_args, funcs, isinstance(x, tuple))
            if self.activation_checkpoint_func is not None:
                x = self.activation_checkpoint_func(block, *args)
            else:
                x = checkpoint(block, *args, use_reentrant=False)
        return x

    def _checkpointable(self, start: int, stop: int) -> bool:
        """Recompute a block only if it holds parameters (else there is nothing to save)
        and, with `checkpointable_layers`, one of the named layer classes."""
        funcs = self.forward_funcs[start:stop]
        if self.checkpointable_layers is not None:
            return any(name in self.checkpointable_layers for name in self._names[start:stop])
        return any(isinstance(f, nn.Module) and any(True for _ in f.parameters()) for f in funcs)


def _run(funcs: Sequence[Callable], x: Any) -> Any:
    for f in funcs:
        x = f(x)
    return x


def _run_args(funcs: Sequence[Callable], as_tuple: bool, *args: Any) -> Any:
    return _run(funcs, args if as_tuple else args[0])
