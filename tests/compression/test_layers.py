"""The wrappers: same parameters, lifecycle, what each technique does in the forward."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from meshspeed.compression.layers import (
    ActivationQuant,
    CompressedEmbedding,
    CompressedLinear,
    Phase,
    Prune,
    WeightQuant,
)
from meshspeed.compression.quantize import quantize_uniform

torch.set_num_threads(1)


def _linear(seed=0, bias=True):
    torch.manual_seed(seed)
    return nn.Linear(8, 6, bias=bias)


def test_wrap_keeps_the_parameter_objects_and_leaves_the_original_alone():
    plain = _linear()
    wrapped = CompressedLinear.wrap(plain)
    assert wrapped.weight is plain.weight and wrapped.bias is plain.bias
    wrapped.add(Prune("row_pruning", 0, method="l1", dense_ratio=0.5))
    wrapped.add(Prune("sparse_pruning", 0, method="topk", dense_ratio=0.5))
    assert set(wrapped.state_dict()) == {"weight", "bias", "row_pruning_mask", "sparse_mask_scores"}
    assert set(plain.state_dict()) == {"weight", "bias"}  # the original got no masks
    assert isinstance(wrapped, nn.Linear)  # still a Linear to other code
    assert "row_pruning waiting" in repr(wrapped)


def test_waiting_techniques_change_nothing_and_active_ones_apply():
    plain = _linear()
    x = torch.randn(3, 8)
    wrapped = CompressedLinear.wrap(plain)
    wrapped.add(WeightQuant("weight_quantization", 5, start_bits=4, target_bits=4))
    wrapped.add(Prune("row_pruning", 7, method="l1", dense_ratio=0.5))
    wrapped.at_step(4)
    assert torch.equal(wrapped(x), plain(x))
    wrapped.at_step(5)
    assert wrapped.compression["weight_quantization"].phase is Phase.ACTIVE
    assert wrapped.compression["row_pruning"].phase is Phase.WAITING
    q = quantize_uniform(plain.weight.detach(), 4)
    assert torch.allclose(wrapped(x), F.linear(x, q, plain.bias))
    wrapped.at_step(7)
    out = wrapped(x)
    kept = wrapped.row_pruning_mask.view(-1).bool()
    assert int(kept.sum()) == 3 and (out[:, ~kept] == 0).all()  # pruned rows and their bias
    assert torch.allclose(out[:, kept], F.linear(x, q, plain.bias)[:, kept])


def test_l1_masks_keep_the_largest_and_topk_scores_learn():
    plain = _linear()
    with torch.no_grad():
        plain.weight[2] *= 100  # the heaviest row
    wrapped = CompressedLinear.wrap(plain)
    wrapped.add(Prune("row_pruning", 0, method="l1", dense_ratio=0.2))  # ceil(0.2 * 6) = 2 rows
    assert wrapped.row_pruning_mask.view(-1).tolist()[2] == 1 and wrapped.row_pruning_mask.sum() == 2
    learnt = CompressedLinear.wrap(_linear())
    learnt.add(Prune("sparse_pruning", 0, method="topk", dense_ratio=0.25))
    learnt.at_step(0)
    learnt(torch.randn(3, 8)).sum().backward()
    assert learnt.sparse_mask_scores.grad is not None and learnt.sparse_mask_scores.grad.abs().sum() > 0
    assert learnt.mask("sparse_pruning").sum() == 12  # 25% of 48


def test_weight_quantization_gradient_is_straight_through():
    plain, twin = _linear(), _linear()
    wrapped = CompressedLinear.wrap(plain)
    wrapped.add(WeightQuant("weight_quantization", 0, start_bits=4, target_bits=4, groups=6))
    wrapped.at_step(0)
    x = torch.randn(5, 8)
    wrapped(x).square().sum().backward()
    q = quantize_uniform(twin.weight.detach(), 4, groups=6).requires_grad_()
    F.linear(x, q, twin.bias).square().sum().backward()
    assert torch.allclose(plain.weight.grad, q.grad)  # the gradient at the quantized point, passed on


def test_dynamic_activation_quantization_is_per_token():
    plain = _linear(bias=False)
    wrapped = CompressedLinear.wrap(plain)
    wrapped.add(ActivationQuant("activation_quantization", 0, bits=4, symmetric=False))
    wrapped.at_step(0)
    x = torch.randn(2, 3, 8) * torch.tensor([1.0, 50.0, 0.01]).view(1, 3, 1)
    expect = F.linear(quantize_uniform(x, 4, groups=6, symmetric=False), plain.weight)
    assert torch.allclose(wrapped(x), expect)


def test_static_activation_range_moves_in_training_only():
    wrapped = CompressedLinear.wrap(_linear())
    wrapped.add(ActivationQuant("activation_quantization", 0, bits=8, static=True))
    wrapped.at_step(0)
    wrapped(torch.tensor([[-1.0] * 4 + [3.0] * 4]))
    assert wrapped.activation_quantizer.x_min_max.tolist() == [-1.0, 3.0]  # first batch: its range
    wrapped(torch.tensor([[-2.0] * 4 + [5.0] * 4]))
    assert wrapped.activation_quantizer.x_min_max.tolist() == pytest.approx([-1.05, 3.1])
    wrapped.eval()
    wrapped(torch.full((1, 8), 100.0))
    assert wrapped.activation_quantizer.x_min_max.tolist() == pytest.approx([-1.05, 3.1])
    assert "activation_quantizer.x_min_max" in wrapped.state_dict()


def test_embedding_quantization_and_the_lifecycle_is_asserted():
    torch.manual_seed(0)
    plain = nn.Embedding(10, 4)
    wrapped = CompressedEmbedding.wrap(plain)
    wrapped.add(WeightQuant("weight_quantization", 0, start_bits=8, target_bits=8, groups=10,
                            in_forward=True))
    wrapped.at_step(0)
    idx = torch.tensor([[1, 7]])
    assert torch.allclose(wrapped(idx), F.embedding(idx, quantize_uniform(plain.weight.detach(), 8, 10)))
    technique = wrapped.compression["weight_quantization"]
    technique.fix()
    with pytest.raises(AssertionError, match="already written"):
        technique.fix()
    with pytest.raises(AssertionError, match="wraps Linear, not Embedding"):
        CompressedLinear.wrap(plain)
