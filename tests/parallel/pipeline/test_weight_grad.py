"""The split backward (meshspeed/parallel/pipeline/weight_grad.py), in one process: I then W
gives the gradients of one ordinary backward, fires each parameter's post-accumulate hook
once (Linear weights in W, everything else in I), and does no more GEMM work than the
ordinary backward (FLOPs counted by torch's FlopCounterMode)."""

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from meshspeed.parallel.pipeline.weight_grad import DeferredWeights


class _Block(nn.Module):
    """Linear layers with and without bias, a LayerNorm, 3-d activations, and one Linear
    applied twice (its weight gets one accumulation per backward, not two)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(6, 8, bias=False)  # its input needs no gradient
        self.norm = nn.LayerNorm(8)
        self.twice = nn.Linear(8, 8)
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        h = self.twice(torch.tanh(self.norm(self.first(x))))
        return self.out(torch.tanh(self.twice(torch.tanh(h))))


def _run(split: bool):
    model = _Block()
    x = torch.randn(2, 5, 6, generator=torch.Generator().manual_seed(1))
    fired: dict[str, list[str]] = {name: [] for name, _ in model.named_parameters()}
    phase = ["I" if split else "B"]
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _, name=name: fired[name].append(phase[0]))
    deferred = DeferredWeights()
    with deferred.capture() if split else torch.enable_grad():
        y = model(x)
    with FlopCounterMode(display=False) as backward:
        y.square().sum().backward()
    with FlopCounterMode(display=False) as weights:
        phase[0] = "W"
        deferred.apply()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return grads, fired, backward.get_total_flops(), weights.get_total_flops(), len(deferred)


def test_input_then_weight_half_equals_one_backward_with_no_more_gemm_work():
    ref, ref_fired, full, nothing, _ = _run(split=False)
    grads, fired, input_half, weight_half, left = _run(split=True)
    for name, g in ref.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-7)
    assert nothing == 0 and left == 0
    assert input_half + weight_half == full  # exactly the GEMMs of the ordinary backward
    assert 0 < input_half < full and weight_half > 0
    assert all(v == ["B"] for v in ref_fired.values())
    linear_weights = {"first.weight", "twice.weight", "out.weight"}
    assert fired == {name: ["W"] if name in linear_weights else ["I"] for name in fired}


def test_nothing_is_deferred_without_grad_or_for_frozen_weights():
    model = nn.Linear(4, 2)
    frozen = nn.Linear(2, 2).requires_grad_(False)
    deferred = DeferredWeights()
    with deferred.capture():
        with torch.no_grad():
            model(torch.randn(3, 4))
        y = frozen(model(torch.randn(3, 4)))
    y.sum().backward()
    assert len(deferred) == 1 and model.weight.grad is None and model.bias.grad is not None
    assert frozen.weight.grad is None
    deferred.apply()
    assert model.weight.grad is not None and len(deferred) == 0
