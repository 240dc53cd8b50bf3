"""What an optimizer block with no weight_decay means: DeepSpeed's default, 0, except under
"torch_adam": true, where DeepSpeed builds torch's class as written and torch's default
applies (Note [no weight_decay means 0] in meshspeed/optim/builder.py)."""

import pytest
import torch

from meshspeed.optim.adam import FusedAdam
from meshspeed.optim.builder import build_optimizer


def _groups():
    return [{"params": [torch.nn.Parameter(torch.ones(3))]}]


# DeepSpeed builds its FusedAdam for "Adam" and "AdamW" (decoupled unless adam_w_mode is
# false) and torch's class only under "torch_adam": true; meshspeed builds the same classes.
@pytest.mark.parametrize(("kind", "params", "cls", "decoupled", "weight_decay"), [
    ("Adam", {"lr": 1e-3}, FusedAdam, True, 0.0),  # the DeepSpeedExamples configs
    ("AdamW", {"lr": 1e-3}, FusedAdam, True, 0.0),
    ("Adam", {"lr": 1e-3, "adam_w_mode": False}, FusedAdam, False, 0.0),
    ("Adam", {"lr": 1e-3, "weight_decay": 0.1}, FusedAdam, True, 0.1),
    ("AdamW", {"lr": 1e-3, "weight_decay": 0.1}, FusedAdam, True, 0.1),
    ("Adam", {"lr": 1e-3, "torch_adam": True}, torch.optim.AdamW, True, 0.01),  # torch.optim.AdamW()
    ("AdamW", {"lr": 1e-3, "torch_adam": True}, torch.optim.AdamW, True, 0.01),
    ("Adam", {"lr": 1e-3, "torch_adam": True, "adam_w_mode": False}, torch.optim.Adam, False, 0.0),
])
def test_default_weight_decay_is_deepspeeds(kind, params, cls, decoupled, weight_decay):
    opt = build_optimizer(kind, params, _groups())
    assert type(opt) is cls
    assert opt.param_groups[0]["decoupled_weight_decay"] is decoupled
    assert opt.param_groups[0]["weight_decay"] == weight_decay


def test_fused_adam_steps_bit_for_bit_like_torch_adamw():
    ref_p, p = (torch.nn.Parameter(torch.linspace(-1, 1, 7)) for _ in range(2))
    ref = torch.optim.AdamW([ref_p], lr=1e-2, weight_decay=0.1, fused=True)
    opt = build_optimizer("Adam", {"lr": 1e-2, "weight_decay": 0.1}, [{"params": [p]}])
    for step in range(3):
        g = torch.sin(torch.arange(7.0) + step)
        ref_p.grad, p.grad = g.clone(), g.clone()
        ref.step()
        opt.step()
    assert torch.equal(p.detach(), ref_p.detach())


def test_adam_without_weight_decay_steps_like_torch_adam():
    """A parameter with a zero gradient does not move (AdamW's default 0.01 would shrink it)."""
    p = torch.nn.Parameter(torch.full((4,), 2.0))
    opt = build_optimizer("Adam", {"lr": 0.1, "betas": [0.9, 0.999], "eps": 1e-8}, [{"params": [p]}])
    p.grad = torch.zeros(4)
    opt.step()
    assert torch.equal(p.detach(), torch.full((4,), 2.0))
