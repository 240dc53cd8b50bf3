"""`meshspeed.zero`: DeepSpeed's user-facing ZeRO helpers.

`GatheredParameters(params, modifier_rank=None)` makes parameters whole for the duration of
a `with` block (under stage 3, and for a model built by `Init` before `meshspeed.initialize`,
they are sharded otherwise); with `modifier_rank` set, the values that rank holds at the
end of the block are broadcast and become every rank's parameters, shards and fp32 master
weights.

`register_external_parameter(module, parameter)` declares that `module`'s forward uses a
parameter another module owns (meshspeed/parallel/zero/external.py); `ZeroParamStatus` is
the type of a partitioned parameter's `ds_status` (meshspeed/parallel/zero/ds_params.py).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from meshspeed.parallel.gather import gathered
from meshspeed.parallel.protocol import ExternalParameters, declares
from meshspeed.parallel.registry import owner_of
from meshspeed.parallel.zero import external
from meshspeed.parallel.zero.ds_params import ZeroParamStatus
from meshspeed.parallel.zero.init import Init

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "register_external_parameter",
           "unregister_external_parameter"]


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """`module`'s forward uses `parameter`, which another module owns. Under stage 3 the
    parameter is then kept whole for every forward and backward (in the root unit).
    Register before `meshspeed.initialize`, e.g. in `module.__init__`; a registration
    after initialize is accepted when no regrouping is needed (the parameter is whole
    whenever `module` runs), and raises otherwise. Stages 0-2 need nothing."""
    owner = owner_of(parameter)
    if declares(owner, ExternalParameters):  # a ZeRO strategy already built
        owner.check_external(module, parameter)
    external.register(module, parameter)


def unregister_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Undo `register_external_parameter` (a unit already built keeps its grouping)."""
    external.unregister(module, parameter)


class GatheredParameters:
    """DeepSpeed's `zero.GatheredParameters(params, modifier_rank=None, fwd_module=None,
    enabled=True)`: meshspeed/parallel/gather.py's `gathered` under DeepSpeed's name."""

    def __init__(self, params: nn.Parameter | Iterable[nn.Parameter], modifier_rank: int | None = None,
                 fwd_module: nn.Module | None = None, enabled: bool = True):
        if isinstance(params, torch.Tensor):
            params = [params]
        self.params = [p for p in params if p is not None]
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self._block = None

    def __enter__(self):
        self._block = gathered(self.params, self.modifier_rank, self.enabled)
        self._block.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb):
        block, self._block = self._block, None
        return block.__exit__(exc_type, exc, tb)
