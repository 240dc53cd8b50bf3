"""`ParamSelection.joined` (Note [model_parameters by name]): after a pipeline rebind a
stage holds layers another rank listed; the exchange gives each the group, the
selection and the frozen flag that rank's user gave it. One process, two stages' selections."""

import torch
from torch import nn

from meshspeed.optim.builder import ParamSelection, adopt_client_optimizer


def _stage(*indices: int) -> nn.Module:
    """Layers registered under their global index, as a pipeline stage does."""
    module = nn.Module()
    for i in indices:
        module.add_module(str(i), nn.Linear(2, 2))
    return module


def _decay_groups(module: nn.Module) -> list[dict]:
    named = list(module.named_parameters())
    return [{"params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.1},
            {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0}]


def _resolve(selection: ParamSelection, module: nn.Module) -> list[tuple[dict, list[str]]]:
    names = {id(p): n for n, p in module.named_parameters()}
    identity = {id(p): p for p in module.parameters()}
    return [({k: v for k, v in g.items() if k != "params"}, sorted(names[id(p)] for p in g["params"]))
            for g in selection.groups(module, identity)]


def test_moved_layers_keep_their_group_selection_and_freezing():
    first, second = _stage(0, 1), _stage(2, 3)  # as the constructor built them
    second.get_parameter("3.weight").requires_grad_(False)
    mine = ParamSelection.capture(_decay_groups(first), first)
    theirs = ParamSelection.capture(_decay_groups(second), second)
    rebound = _stage(0, 3)  # after the rebind: layer 3 moved here, layer 1 left
    joined = mine.joined([mine.named, theirs.named], rebound)
    joined.keep_frozen(rebound)
    assert not rebound.get_parameter("3.weight").requires_grad
    assert _resolve(joined, rebound) == [({"weight_decay": 0.1}, ["0.weight"]),
                                         ({"weight_decay": 0.0}, ["0.bias", "3.bias"])]


def test_a_narrow_selection_stays_narrow_and_unknown_options_make_a_group():
    first, second = _stage(0, 1), _stage(2, 3)
    mine = ParamSelection.capture([first.get_parameter("1.weight")], first)  # a fine-tune of one tensor
    theirs = ParamSelection.capture([{"params": [second.get_parameter("3.weight")], "lr": 0.5}], second)
    rebound = _stage(1, 3)
    joined = mine.joined([mine.named, theirs.named], rebound)
    assert not joined.whole
    assert _resolve(joined, rebound) == [({}, ["1.weight"]), ({"lr": 0.5}, ["3.weight"])]
    # a client optimizer built before initialize takes the extra group too
    opt = torch.optim.SGD([first.get_parameter("1.weight")], lr=0.1)
    identity = {id(p): p for p in rebound.parameters()}
    adopted = adopt_client_optimizer(opt, joined.groups(rebound, identity))
    assert [g["lr"] for g in adopted.param_groups] == [0.1, 0.5]
    assert adopted.param_groups[1]["params"][0] is rebound.get_parameter("3.weight")


def test_the_whole_model_only_if_every_stage_listed_all_of_its_own():
    first, second = _stage(0, 1), _stage(2, 3)
    mine = ParamSelection.capture(list(first.parameters()), first)
    everything = ParamSelection.capture(list(second.parameters()), second)
    assert mine.whole and everything.whole
    rebound = _stage(0, 3)
    assert mine.joined([mine.named, everything.named], rebound).whole
    narrow = ParamSelection.capture([second.get_parameter("2.weight")], second)
    assert not mine.joined([mine.named, narrow.named], rebound).whole
