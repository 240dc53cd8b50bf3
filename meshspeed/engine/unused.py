"""`zero_optimization.ignore_unused_parameters: false`: refuse to step while a trainable
parameter got no gradient in the accumulation window.

A step part (meshspeed/parallel/protocol.py `StepPart`) the engine is built with only
when the key is false. A post-accumulate-grad hook on each trainable parameter records
that it received a gradient; at the boundary step every rank shares the names it is
missing, so that all ranks raise together (one rank raising alone would leave the others
waiting in the step's collectives) with every missing name in the message.
"""

from __future__ import annotations

from torch import nn

from meshspeed import comm
from meshspeed.engine.errors import UnusedParametersError
from meshspeed.parallel.step import NormScope

MAX_NAMED = 8  # names spelled out in the message; the rest are counted


class UnusedParameterCheck:
    """Raises `UnusedParametersError` at a step whose window left trainable parameters
    without a gradient. Stage-independent: it looks only at the module's parameters."""

    def __init__(self, module: nn.Module):
        self._names = {id(p): n for n, p in module.named_parameters() if p.requires_grad}
        self._seen: set[int] = set()
        self._handles = [p.register_post_accumulate_grad_hook(self._saw)
                         for p in module.parameters() if p.requires_grad]

    def _saw(self, param: nn.Parameter) -> None:
        self._seen.add(id(param))

    def before_step(self, strategy) -> None:
        missing = [n for i, n in self._names.items() if i not in self._seen]
        self._seen.clear()
        everywhere = comm.all_gather_object(missing) if comm.is_initialized() else [missing]
        if not any(everywhere):
            return
        named = sorted({n for names in everywhere for n in names})
        shown = ", ".join(named[:MAX_NAMED]) + (f" and {len(named) - MAX_NAMED} more" if len(named) > MAX_NAMED else "")
        raise UnusedParametersError(
            f"zero_optimization.ignore_unused_parameters is false and {len(named)} trainable "
            f"parameter(s) got no gradient in this accumulation window ({shown}): make them take "
            "part in the loss, freeze them (requires_grad=False), or set ignore_unused_parameters "
            "to true to step without them")

    def widen(self, scope: NormScope, strategy) -> NormScope:
        return scope
