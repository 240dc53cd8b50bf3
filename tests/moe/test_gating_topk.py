"""`topk_routing` and `Gate` with k >= 3 (Note [top-k routing] in meshspeed/moe/gating.py),
on fixed logits whose routing is worked out by hand below."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from meshspeed.moe.gating import Gate, topk_routing

# k=2 of 3 experts, 4 tokens; capacity_factor 0.5 gives ceil(4 / 3 * 0.5 * 2) = 2 slots.
# Top-2 experts: t0 {0, 1}, t1 {0, 2}, t2 {1, 2}, t3 {0, 1}: expert 0 is chosen by t0, t1,
# t3 (gates 0.490, 0.705, 0.867), expert 1 by t0, t2, t3 (0.444, 0.705, 0.117), expert 2 by
# t1, t2: experts 0 and 1 are over-full by one token each.
LOGITS = torch.tensor([[1.0, 0.9, -1.0], [2.0, -1.0, 1.0], [-1.0, 2.0, 1.0], [3.0, 1.0, -1.0]])
GATES = torch.softmax(LOGITS, dim=1)
EXPERTS = [[0, 1], [0, 2], [1, 2], [0, 1]]  # columns in decreasing gate order


def _weights(keep: list[list[bool]]) -> torch.Tensor:
    """Each token's kept gates, renormalised to sum to 1 (0 where nothing is kept)."""
    g = torch.stack([GATES[s, EXPERTS[s]] for s in range(4)]) * torch.tensor(keep)
    return g / g.sum(1, keepdim=True).clamp(min=torch.finfo(torch.float32).eps)


def test_probs_keeps_each_experts_largest_gates():
    r = topk_routing(LOGITS, 2, 0.5, 0)  # drop_policy="probs"
    assert r.capacity == 2
    assert r.expert_index.tolist() == EXPERTS
    # expert 0 keeps t1, t3 (drops t0: 0.490 is its smallest); expert 1 keeps t0, t2 (drops
    # t3: 0.117); slots in token order among the kept
    assert r.slot.tolist() == [[-1, 0], [0, 0], [1, 1], [1, -1]]
    assert_close(r.weight, _weights([[False, True], [True, True], [True, True], [True, False]]))
    assert r.weight[0].tolist() == [0.0, 1.0]
    assert r.exp_counts.tolist() == [3, 3, 2]  # before drops


def test_position_keeps_each_experts_first_tokens():
    r = topk_routing(LOGITS, 2, 0.5, 0, drop_policy="position")
    # expert 0 keeps t0, t1; expert 1 keeps t0, t2: t3 loses both choices
    assert r.slot.tolist() == [[0, 0], [1, 0], [1, 1], [-1, -1]]
    assert r.weight[3].tolist() == [0.0, 0.0]
    assert_close(r.weight[0], GATES[0, [0, 1]] / GATES[0, [0, 1]].sum())


def test_dropless_capacity_is_the_busiest_expert():
    r = topk_routing(LOGITS, 2, 0.5, 0, drop_tokens=False)
    assert r.capacity == 3
    assert r.slot.tolist() == [[0, 0], [1, 0], [1, 1], [2, 2]]
    assert_close(r.weight, _weights([[True, True]] * 4))


def test_balance_loss_counts_every_choice_over_k():
    r = topk_routing(LOGITS, 2, 0.5, 0)
    fraction = torch.tensor([3 / 4, 3 / 4, 2 / 4])  # tokens choosing each expert
    assert_close(r.l_aux, 3 / 2 * (GATES.mean(0) * fraction).sum())
    uniform = topk_routing(torch.zeros(6, 4), 3, 1.0, 0)
    assert_close(uniform.l_aux, torch.tensor(1.0))


def test_min_capacity_and_used_token():
    assert topk_routing(LOGITS, 2, 0.5, 7).capacity == 7
    r = topk_routing(LOGITS, 2, 0.5, 0, used_token=torch.tensor([1, 0, 1, 1]))
    # without t1, expert 0 holds t0, t3 and expert 1 still drops t3
    assert r.slot.tolist() == [[0, 0], [-1, -1], [1, 0], [1, -1]]
    assert r.exp_counts.tolist() == [2, 3, 1]


def test_dispatch_and_combine_follow_the_slots():
    r = topk_routing(LOGITS, 2, 0.5, 0)
    x = torch.arange(8.0).view(4, 2)
    buffer = r.dispatch(x)
    assert buffer[0].tolist() == [x[1].tolist(), x[3].tolist()]  # expert 0: t1, t3
    assert buffer[1].tolist() == [x[0].tolist(), x[2].tolist()]
    assert_close(r.combine(buffer), x)  # weights sum to 1 for every token with a kept choice


@pytest.mark.parametrize("kwargs, message", [
    ({"drop_policy": "random"}, "drop_policy='random' is not one of 'probs', 'position'"),
    ({"k": 4}, "topk_routing: 3 expert\\(s\\) for k=4"),
    ({"k": 0}, "k=0; it must be an int >= 1"),
])
def test_bad_arguments_say_what_is_wrong(kwargs, message):
    kwargs = {"k": 2, **kwargs}
    with pytest.raises(ValueError, match=message):
        topk_routing(LOGITS, kwargs.pop("k"), 0.5, 0, **kwargs)


def test_gate_with_k3_routes_top3():
    torch.manual_seed(0)
    gate = Gate(4, 5, 3, capacity_factor=10.0, min_capacity=0)
    x = torch.randn(6, 4)
    r = gate(x)
    logits = x @ gate.wg.weight.t()
    assert r.expert_index.tolist() == logits.topk(3, dim=1).indices.tolist()
    assert r.capacity == 36 and bool(r.kept.all())
    assert_close(r.weight.sum(1), torch.ones(6))
