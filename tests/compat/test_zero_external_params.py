"""`zero.register_external_parameter`: a block whose forward uses a parameter of another
block (the way DeepSpeed documents it: registered in the constructor) trains at stage 3
like the one-process model; without the registration the parameter is an empty
placeholder there and the forward fails. World 2, gloo."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import meshspeed
from meshspeed.testing import run_distributed
from tests.compat.models import one_thread


class Block(nn.Module):
    def __init__(self, partner: nn.Linear | None = None, register: bool = True):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self._partner = [partner]  # a plain reference: not a submodule of this block
        if partner is not None and register:
            meshspeed.zero.register_external_parameter(self, partner.weight)

    def forward(self, x):
        y = torch.tanh(self.lin(x))
        partner = self._partner[0]
        if partner is not None:
            y = y + F.linear(x, partner.weight)  # another block's weight, in this forward
        return y


class Net(nn.Module):
    def __init__(self, register: bool = True):
        super().__init__()
        first = Block()
        self.layers = nn.ModuleList([first, Block(first.lin, register), Block()])
        self.head = nn.Linear(8, 1)

    def forward(self, x, y):
        for layer in self.layers:
            x = layer(x)
        return F.mse_loss(self.head(x).squeeze(-1), y)


def _data(steps=3):
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, generator=g)) for _ in range(steps)]


def _config(stage):
    return {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10_000,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}


def _train(register, under_init):
    torch.manual_seed(0)
    if under_init:
        with meshspeed.zero.Init():
            model = Net(register)
    else:
        model = Net(register)
    engine, *_ = meshspeed.initialize(model=model, model_parameters=model.parameters(), config=_config(3))
    losses = []
    try:
        for x, y in _data():  # the same batch on every rank
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    except RuntimeError as err:
        return str(err)
    from meshspeed.testing.parity import full_state_dict

    return losses, full_state_dict(engine)


@one_thread()
def _reference():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x, y in _data():
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("under_init", [False, True])
def test_registered_external_parameter_trains_like_one_process(under_init):
    ref_losses, ref_state = _reference()
    for losses, state in run_distributed(_train, world_size=2, args=(True, under_init)):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-6, atol=0)
        for name, value in ref_state.items():
            torch.testing.assert_close(state[name], value, rtol=1e-6, atol=1e-7, msg=name)


def test_unregistered_use_fails():
    for message in run_distributed(_train, world_size=2, args=(False, False)):
        assert isinstance(message, str) and "size mismatch" in message, message  # (0,) placeholder


def _misuse():
    torch.manual_seed(0)
    model = Net(register=False)
    out = {}
    try:
        meshspeed.zero.register_external_parameter(model, torch.zeros(2))
    except RuntimeError as err:
        out["not a parameter"] = str(err)
    try:
        meshspeed.zero.unregister_external_parameter(model, model.head.weight)
    except RuntimeError as err:
        out["not registered"] = str(err)
    meshspeed.zero.register_external_parameter(model, model.head.weight)
    meshspeed.zero.unregister_external_parameter(model, model.head.weight)  # and it is gone:
    try:
        meshspeed.zero.unregister_external_parameter(model, model.head.weight)
    except RuntimeError as err:
        out["twice"] = str(err)
    engine = meshspeed.initialize(model=model, model_parameters=model.parameters(), config=_config(3))[0]
    block2 = engine.module.layers[2]
    meshspeed.zero.register_external_parameter(block2, block2.lin.weight)  # its own: fine
    meshspeed.zero.register_external_parameter(model.head, model.head.weight)  # its own unit's
    try:  # another block's parameter, after initialize: would need regrouping
        meshspeed.zero.register_external_parameter(block2, model.layers[0].lin.weight)
    except RuntimeError as err:
        out["after initialize"] = str(err)
    try:  # the head is a unit of its own (Note [the root unit split]), whole only around its use
        meshspeed.zero.register_external_parameter(block2, model.head.weight)
    except RuntimeError as err:
        out["head after initialize"] = str(err)
    return out


def test_misuse_is_reported():
    for out in run_distributed(_misuse, world_size=2):
        assert "not a torch.nn.Parameter" in out["not a parameter"]
        assert "not a registered external parameter" in out["not registered"]
        assert "not a registered external parameter" in out["twice"]
        assert "before initialize" in out["after initialize"]
        assert "unit head" in out["head after initialize"]
