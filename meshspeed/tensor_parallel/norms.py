"""Norms in the sequence-parallel region (arXiv:2205.05198, section 4.2.2).

A LayerNorm / RMSNorm between a row layer's reduce-scatter and the next column layer's
all-gather sees only this rank's sequence shard; the module itself is unchanged, and its
activations are 1/t of plain TP's. Its parameters are replicated, but each rank's
gradient of them covers its shard only: a partial sum over the tp group. Such modules
list those parameters in `module.tp_partial_grads`; the engine all-reduces their
gradients over tp once per step (spec.partial_grad_params finds them).
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn


def mark_sequence_parallel(module: nn.Module, names: Iterable[str] | None = None) -> nn.Module:
    """Mark `module`'s own parameters (all of them, or `names`) as having tp-partial
    gradients. Returns the module."""
    own = [name for name, _ in module.named_parameters(recurse=False)]
    chosen = tuple(own if names is None else names)
    missing = [n for n in chosen if n not in own]
    if missing:
        raise ValueError(f"{type(module).__name__} has no parameters {missing}")
    module.tp_partial_grads = tuple(dict.fromkeys(getattr(module, "tp_partial_grads", ()) + chosen))
    return module
