"""The forms in which users pass `model_parameters` to `initialize` (Note [model_parameters
by name] in optim/builder.py), and the matching parameter groups for a one-process reference.

- "parameters": `model.parameters()`, the plain call;
- "generator": `(p for p in model.parameters() if p.requires_grad)`;
- "list": `[p for p in model.parameters() if p.requires_grad]`, the filtered list;
- "filter": `filter(lambda p: p.requires_grad, model.parameters())`;
- "groups": weight-decay groups as Hugging Face and DeepSpeed-Chat build them: matrices in
  one group with the optimizer's decay, biases and norm weights (one dimension) in another
  with `weight_decay` 0.0.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

FORMS = ("parameters", "generator", "list", "filter", "groups")


def _matrix(p) -> bool:
    """Two or more dimensions; under zero.Init the placeholder is empty and DeepSpeed's
    `ds_shape` holds the parameter's shape."""
    return len(getattr(p, "ds_shape", p.shape)) > 1


def _decay_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if _matrix(p)], "weight_decay": weight_decay},
            {"params": [p for p in params if not _matrix(p)], "weight_decay": 0.0}]


def model_parameters(model: nn.Module, form: str, weight_decay: float) -> Iterable:
    """What a user's script passes as `initialize(model_parameters=...)` in `form`."""
    if form == "parameters":
        return model.parameters()
    if form == "generator":
        return (p for p in model.parameters() if p.requires_grad)
    if form == "list":
        return [p for p in model.parameters() if p.requires_grad]
    if form == "filter":
        return filter(lambda p: p.requires_grad, model.parameters())
    if form == "groups":
        return _decay_groups(model, weight_decay)
    raise ValueError(f"unknown model_parameters form {form!r}; expected one of {', '.join(FORMS)}")


def reference_groups(model: nn.Module, form: str, weight_decay: float) -> list[dict]:
    """The torch optimizer's param groups that train like `form` in one process."""
    if form == "groups":
        return _decay_groups(model, weight_decay)
    return [{"params": [p for p in model.parameters() if p.requires_grad]}]
