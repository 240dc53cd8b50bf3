"""Parameters a module uses in its forward that another module owns (DeepSpeed's
`register_external_parameter`).

Under stage 3 a block's parameters are whole only while that block runs (and around its
backward). A parameter read by some other module's forward, say layer 2 calling
`F.linear(x, layer1.weight)`, would then be an empty placeholder. Registering the use
before `meshspeed.initialize` (typically in the constructor, as DeepSpeed documents)
tells the stage-3 grouping (grouping.py) to keep that parameter in the root unit, whole
for every forward and backward; a use inside the owner's own block needs nothing.

Registrations are kept per module, held weakly by it.
"""

from __future__ import annotations

from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

# module -> {id(param): param} registered as used in its forward
_USES: WeakIdKeyDictionary = WeakIdKeyDictionary()


def register(module: nn.Module, param: nn.Parameter) -> None:
    if not isinstance(param, nn.Parameter):
        # RuntimeError, as DeepSpeed raises (scripts may catch it)
        raise RuntimeError("register_external_parameter: the parameter is not a torch.nn.Parameter")  # noqa: TRY004
    _USES.setdefault(module, {})[id(param)] = param


def unregister(module: nn.Module, param: nn.Parameter) -> None:
    if not isinstance(param, nn.Parameter):
        raise RuntimeError("unregister_external_parameter: the parameter is not a torch.nn.Parameter")  # noqa: TRY004
    uses = _USES.get(module, {})
    if id(param) not in uses:
        raise RuntimeError("unregister_external_parameter: the parameter is not a registered external "
                           f"parameter of this {type(module).__name__}")
    del uses[id(param)]


def external_uses(root: nn.Module) -> list[tuple[nn.Module, nn.Parameter]]:
    """(module, parameter) for every registration made on `root` or its submodules."""
    return [(m, p) for m in root.modules() for p in _USES.get(m, {}).values()]
