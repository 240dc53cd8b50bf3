"""Optimizer parameters of the wrong type are named with the key (issue 9 case 8: a string
lr used to surface as "'<=' not supported between instances of 'float' and 'str'")."""

import pytest
import torch

from meshspeed.optim.builder import build_optimizer


def _groups():
    return [{"params": [torch.nn.Parameter(torch.zeros(3))]}]


@pytest.mark.parametrize("kind, params, key", [
    ("AdamW", {"lr": "1e-3"}, "lr"),
    ("Adam", {"lr": 1e-3, "weight_decay": "0.1"}, "weight_decay"),
    ("SGD", {"lr": 0.1, "momentum": True}, "momentum"),
    ("AdamW", {"lr": 1e-3, "eps": None}, "eps"),
])
def test_non_numbers_are_named(kind, params, key):
    with pytest.raises(ValueError) as err:
        build_optimizer(kind, params, _groups())
    assert str(err.value).startswith(f"optimizer.params.{key}: expected a number, got ")


@pytest.mark.parametrize("betas", [[0.9], "0.9,0.99", [0.9, "0.99"]])
def test_betas_must_be_two_numbers(betas):
    with pytest.raises(ValueError, match=r"optimizer.params.betas: expected two numbers"):
        build_optimizer("AdamW", {"lr": 1e-3, "betas": betas}, _groups())


def test_numbers_still_build():
    opt = build_optimizer("AdamW", {"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0}, _groups())
    assert opt.defaults["lr"] == 1e-3 and opt.defaults["betas"] == (0.9, 0.95)
