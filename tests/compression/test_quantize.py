"""Fake quantization: grids, per-group scales, the straight-through gradient, MoQ's schedule."""

import pytest
import torch

from meshspeed.compression.quantize import (
    moq_bits,
    moq_real_share,
    quantize,
    quantize_binary,
    quantize_ternary,
    quantize_uniform,
    straight_through,
)

torch.set_num_threads(1)


@pytest.mark.parametrize("bits", [8, 4])
def test_symmetric_grid_has_one_scale_per_group(bits):
    torch.manual_seed(0)
    x = torch.randn(4, 16) * torch.tensor([[1.0], [10.0], [0.1], [3.0]])  # rows of different size
    q = quantize_uniform(x, bits, groups=4, symmetric=True)
    for row, qrow in zip(x, q):
        scale = 2 * row.abs().max() / 2**bits
        levels = qrow / scale
        assert torch.allclose(levels, levels.round(), atol=1e-4)  # on this row's own grid
        assert levels.min() >= -(2 ** (bits - 1)) and levels.max() <= 2 ** (bits - 1) - 1
        assert (qrow - row).abs().max() <= scale * 1.001  # the top value is clamped one level down
    assert len(set(q.unique().tolist())) <= 4 * 2**bits


@pytest.mark.parametrize("bits", [8, 4])
def test_asymmetric_grid_follows_min_and_max(bits):
    torch.manual_seed(0)
    x = torch.rand(2, 32) * 5 + 1  # all positive: asymmetric spends every level on [1, 6]
    q = quantize_uniform(x, bits, groups=2, symmetric=False)
    for row, qrow in zip(x, q):
        assert len(qrow.unique()) <= 2**bits
        assert (qrow - row).abs().max() <= 2 * (row.max() - row.min()) / 2**bits  # zero point rounded
    sym = quantize_uniform(x, bits, groups=2, symmetric=True)
    assert (q - x).abs().mean() < (sym - x).abs().mean()


def test_int4_is_coarser_than_int8_and_groups_help():
    torch.manual_seed(0)
    x = torch.randn(8, 64) * torch.logspace(-2, 1, 8).view(8, 1)
    err = {(b, g): (quantize_uniform(x, b, g) - x).abs().mean() for b in (4, 8) for g in (1, 8)}
    assert err[(8, 1)] < err[(4, 1)] and err[(8, 8)] < err[(8, 1)] and err[(4, 8)] < err[(4, 1)]


def test_zero_group_stays_zero_and_stochastic_rounding_is_unbiased():
    x = torch.zeros(2, 4)
    assert torch.equal(quantize_uniform(x, 8, 2), x)  # no 0/0
    torch.manual_seed(0)
    x = torch.full((20000,), 0.3)
    x[0] = 1.0  # sets the range: scale 2/16, 0.3 sits between 0.25 and 0.375
    q = quantize_uniform(x, 4, stochastic=True)
    assert set(q[1:].unique().tolist()) == {0.25, 0.375}
    assert abs(q[1:].mean().item() - 0.3) < 0.003


def test_ternary_and_binary():
    x = torch.tensor([[-2.0, -0.1, 0.05, 1.0, 3.0, 0.0]])
    t = quantize_ternary(x)
    assert set(t.unique().tolist()) <= {-2.0, 0.0, 2.0}  # alpha = mean |x| over kept = 2
    assert t[0, 1] == 0 and t[0, 4] == 2.0
    b = quantize_binary(torch.tensor([[-1.0, 3.0]]))
    assert b.tolist() == [[-2.0, 2.0]]
    assert torch.equal(quantize(x, 2, 1, True), t)


def test_straight_through_gradient_is_the_identity():
    torch.manual_seed(0)
    x = torch.randn(6, 8, requires_grad=True)
    y = straight_through(x, quantize_uniform(x, 4, groups=6))
    upstream = torch.randn(6, 8)
    (y * upstream).sum().backward()
    assert torch.equal(x.grad, upstream)  # d(quantize)/dx = 1 over the whole (clip) range
    assert torch.equal(y, quantize_uniform(x.detach(), 4, groups=6))


def test_moq_bits_drop_one_at_a_time_with_the_period_doubling():
    # DeepSpeed's Quantizer.compute_quantization: at quantization k, if k >= period: one bit
    # less and the period doubles
    got = [moq_bits(k, start=8, target=4, period=10) for k in (1, 9, 10, 19, 20, 39, 40, 79, 80, 500)]
    assert got == [8, 8, 7, 7, 6, 6, 5, 5, 4, 4]
    assert [moq_bits(k, 4, 4, 1) for k in (1, 100)] == [4, 4]
    assert [moq_bits(k, 8, 2, 1) for k in (1, 2, 3, 4, 8, 16, 32)] == [7, 6, 6, 5, 4, 3, 2]


def _moq_reference(steps, start, target, period, change):
    """DeepSpeed's loop, transcribed as a stateful walk, for comparison."""
    bits, ratio, out = start, 1.0, []
    for k in range(1, steps + 1):
        ratio = max(0.0, ratio - change)
        if bits != target and k >= period:
            ratio, period, bits = 1.0, period * 2, bits - 1
        out.append((bits, ratio))
    return out


def test_moq_schedule_matches_a_step_by_step_walk():
    walk = _moq_reference(200, 8, 4, 7, 0.01)
    for k, (bits, ratio) in enumerate(walk, start=1):
        assert moq_bits(k, 8, 4, 7) == bits
        assert moq_real_share(k, 8, 4, 7, 0.01) == pytest.approx(ratio)
