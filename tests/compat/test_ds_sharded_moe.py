"""`deepspeed.moe.sharded_moe` (meshspeed/compat/deepspeed/moe/sharded_moe.py): DeepSpeed's
gating functions in DeepSpeed's dense and sparse forms, on fixed logits whose routing is
worked out by hand; `deepspeed.utils.groups._get_expert_parallel_ranks`; and the
`deepspeed.moe` package still reaching meshspeed's own MoE modules."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from meshspeed.compat.deepspeed.moe import sharded_moe
from meshspeed.compat.deepspeed.moe.sharded_moe import (
    TopKGate,
    _route_slots,
    _sparse_decode,
    _sparse_encode,
    top1gating,
    top2gating,
    topkgating,
)
from meshspeed.compat.deepspeed.utils.groups import _get_expert_parallel_ranks


def sigmoid(d: float) -> float:
    return 1.0 / (1.0 + math.exp(-d))


# -- top-1: 6 tokens, 2 experts, capacity ceil(6 / 2 * 1.0) = 3 ---------------------------------
# Tokens 0-4 prefer expert 0 (logit margins 2, 1, 3, 0.5, 1.5), token 5 expert 1 (margin 1).
LOGITS1 = torch.tensor([[2.0, 0], [1, 0], [3, 0], [0.5, 0], [1.5, 0], [0, 1]])
GATE1 = [sigmoid(2), sigmoid(1), sigmoid(3), sigmoid(0.5), sigmoid(1.5), sigmoid(1)]  # chosen gate


def test_top1_without_rts_keeps_the_first_tokens():
    l_aux, combine, mask, counts = top1gating(LOGITS1, 1.0, 0, use_rts=False)
    assert combine.shape == mask.shape == (6, 2, 3) and mask.dtype == torch.bool
    expected = torch.zeros(6, 2, 3)
    for s, (e, c) in {0: (0, 0), 1: (0, 1), 2: (0, 2), 5: (1, 0)}.items():  # 3 and 4 dropped
        expected[s, e, c] = GATE1[s]
    assert_close(combine, expected)
    assert torch.equal(mask, expected > 0)
    assert counts.tolist() == [5, 1]
    mean_gate0 = sum(GATE1[:5]) / 6 + (1 - GATE1[5]) / 6
    assert_close(l_aux, torch.tensor(2 * (mean_gate0 * 5 / 6 + (1 - mean_gate0) * 1 / 6)))


def test_top1_sparse_form():
    _, cap, num_experts, indices, locations, gates, counts = top1gating(
        LOGITS1, 1.0, 0, use_rts=False, sparse_routes=True)
    assert int(cap) == 3 and num_experts == 2 and counts.tolist() == [5, 1]
    assert indices.dtype == locations.dtype == torch.int32
    assert indices.tolist() == [[0, 0, 0, -1, -1, 1]]
    assert locations.tolist() == [[0, 1, 2, 0, 0, 0]]
    assert_close(gates, torch.tensor([GATE1[:3] + [0.0, 0.0, GATE1[5]]]))


def test_top1_dropless_keeps_every_token():
    _, combine, _, _ = top1gating(LOGITS1, 1.0, 0, drop_tokens=False, use_rts=False)
    assert combine.shape == (6, 2, 5)  # the busiest expert's 5 tokens
    assert [tuple(i) for i in combine.nonzero().tolist()] == [
        (0, 0, 0), (1, 0, 1), (2, 0, 2), (3, 0, 3), (4, 0, 4), (5, 1, 0)]
    assert_close(combine.sum((1, 2)), torch.tensor(GATE1))


def test_top1_rts_keeps_the_highest_priorities():
    torch.manual_seed(3)
    priority = torch.rand(6, 2)[:5, 0]  # the one draw RTS makes: tokens 0-4 at expert 0
    torch.manual_seed(3)
    _, _, _, indices, locations, _, _ = top1gating(LOGITS1, 1.0, 0, sparse_routes=True)
    kept = sorted(priority.topk(3).indices.tolist())
    assert [s for s in range(5) if indices[0, s] == 0] == kept
    assert [int(locations[0, s]) for s in kept] == [0, 1, 2]  # slots in token order


# -- top-2: 4 tokens, 3 experts, capacity ceil(4 / 3 * 0.5 * 2) = 2 ------------------------------
# First choices t0->1, t1->0, t2->1, t3->0; second t0->2, t1->2, t2->2, t3->1. Expert 1 holds its
# first choices t0, t2, so t3's second is dropped; expert 2 holds t0, t1, so t2's is dropped.
LOGITS2 = torch.tensor([[0.1, 0.9, 0.2], [0.8, 0.1, 0.3], [0.4, 0.6, 0.5], [0.7, 0.2, 0.1]])
GATES2 = torch.softmax(LOGITS2, dim=1)


def test_top2_drops_second_choices_past_capacity():
    l_aux, combine, mask, counts = top2gating(LOGITS2, 0.5, 0, top2_2nd_expert_sampling=False)
    assert combine.shape == (4, 3, 2)
    share = {0: GATES2[0, 1] / (GATES2[0, 1] + GATES2[0, 2]), 1: GATES2[1, 0] / (GATES2[1, 0] + GATES2[1, 2])}
    expected = torch.zeros(4, 3, 2)
    expected[0, 1, 0], expected[0, 2, 0] = share[0], 1 - share[0]
    expected[1, 0, 0], expected[1, 2, 1] = share[1], 1 - share[1]
    expected[2, 1, 1] = 1.0  # its only kept choice takes the whole weight
    expected[3, 0, 1] = 1.0
    assert_close(combine, expected)
    assert torch.equal(mask, expected > 0)
    assert counts.tolist() == [2, 3, 3]
    first = torch.tensor([0.5, 0.5, 0.0])  # the balance loss counts first choices only
    assert_close(l_aux, 3 * (GATES2.mean(0) * first).sum())


def test_top2_dropless_and_sparse():
    _, cap, _, indices, locations, gates, _ = top2gating(
        LOGITS2, 0.5, 0, drop_tokens=False, top2_2nd_expert_sampling=False, sparse_routes=True)
    assert int(cap) == 3
    assert indices.tolist() == [[1, 0, 1, 0], [2, 2, 2, 1]]
    assert locations.tolist() == [[0, 0, 1, 1], [0, 1, 2, 2]]  # seconds after the firsts
    assert_close(gates.sum(0), torch.ones(4))


# -- top-k (meshspeed/moe tests/moe/test_gating_topk.py has the routing; here its forms) --------
LOGITSK = torch.tensor([[1.0, 0.9, -1.0], [2.0, -1.0, 1.0], [-1.0, 2.0, 1.0], [3.0, 1.0, -1.0]])


@pytest.mark.parametrize("policy, kept", [
    ("probs", [(0, 1, 0), (1, 0, 0), (1, 2, 0), (2, 1, 1), (2, 2, 1), (3, 0, 1)]),
    ("position", [(0, 0, 0), (0, 1, 0), (1, 0, 1), (1, 2, 0), (2, 1, 1), (2, 2, 1)]),
])
def test_topk_drop_policies(policy, kept):
    _, combine, mask, counts = topkgating(LOGITSK, 2, 0.5, 0, drop_policy=policy)
    assert [tuple(i) for i in mask.nonzero().tolist()] == kept
    assert counts.tolist() == [3, 3, 2]
    assert_close(combine.sum((1, 2))[:3], torch.ones(3))


def test_topk_sparse_matches_dense():
    dense = topkgating(LOGITSK, 2, 0.5, 0)
    _, cap, num_experts, indices, locations, gates, _ = topkgating(LOGITSK, 2, 0.5, 0, sparse_routes=True)
    assert indices.tolist() == [[-1, 0, 1, 0], [1, 2, 2, -1]]  # rows: each token's 1st, 2nd choice
    slots = _route_slots(indices, locations, num_experts, int(cap))
    assert slots.tolist() == [[6, 0, 3, 1], [2, 4, 5, 6]]  # dropped: row E * C = 6
    x = torch.arange(8.0).view(4, 2)
    assert_close(_sparse_encode(x, slots, 3, 2), torch.einsum("sec,sm->ecm", dense[2].float(), x))
    out = torch.randn(3, 2, 2)
    assert_close(_sparse_decode(out.view(6, 2), slots, gates, 4),
                 torch.einsum("sec,ecm->sm", dense[1], out))


# -- the ep group ---------------------------------------------------------------------------------


def test_dropless_capacity_is_reduced_over_the_ep_group(monkeypatch):
    calls = []

    def fake_all_reduce(tensor, op=None, group=None):
        calls.append((op, group))
        tensor.fill_(9)  # another rank's busiest expert has 9 tokens

    monkeypatch.setattr(sharded_moe.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(sharded_moe.dist, "all_reduce", fake_all_reduce)
    group = object()
    _, combine, _, _ = top1gating(LOGITS1, 1.0, 0, drop_tokens=False, use_rts=False, ep_group=group)
    assert combine.shape == (6, 2, 9)
    assert calls == [(torch.distributed.ReduceOp.MAX, group)]
    top2gating(LOGITS2, 1.0, 0, drop_tokens=False, ep_group=None)  # no group: no call
    topkgating(LOGITSK, 2, 1.0, 0, drop_tokens=True, ep_group=group)  # capacity mode: no call
    assert len(calls) == 1


def test_topkgate_has_deepspeeds_signature_and_forms():
    torch.manual_seed(0)
    gate = TopKGate(4, 3, 2, 1.0, 1.0)
    assert gate.min_capacity == 8 and gate.ep_group is None
    _, combine, _, counts = gate(torch.randn(5, 4))
    assert combine.shape == (5, 3, 8) and int(counts.sum()) == 10
    gate._set_ep_group("group")
    with pytest.raises(AssertionError, match="already has an expert-parallel group"):
        gate._set_ep_group("other")


def test_bad_noisy_gate_policy():
    with pytest.raises(ValueError, match="noisy_gate_policy='Gumbel' is not one of"):
        top1gating(LOGITS1, 1.0, 0, noisy_gate_policy="Gumbel")


# -- groups and paths -----------------------------------------------------------------------------


def test_expert_parallel_ranks_in_deepspeeds_order():
    ep, edp = _get_expert_parallel_ranks(16, 2, 4)
    assert ep == [[0, 2, 4, 6], [8, 10, 12, 14], [1, 3, 5, 7], [9, 11, 13, 15]]
    assert edp == [[0, 8], [2, 10], [4, 12], [6, 14], [1, 9], [3, 11], [5, 13], [7, 15]]
    ep, edp = _get_expert_parallel_ranks(8, 1, 2, pipeline_parallel_size_=2)
    assert ep == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert edp == [[0, 2], [1, 3], [4, 6], [5, 7]]
    with pytest.raises(AssertionError, match="ep 3 must divide dp 8"):
        _get_expert_parallel_ranks(16, 2, 3)


def test_deepspeed_moe_reaches_meshspeeds_modules():
    from meshspeed.compat.alias import install, uninstall

    install()
    try:
        import deepspeed.moe
        import deepspeed.moe.layer
        import deepspeed.moe.sharded_moe
        import deepspeed.moe.utils

        import meshspeed.moe.layer
        import meshspeed.moe.utils

        assert deepspeed.moe.layer is meshspeed.moe.layer
        assert deepspeed.moe.utils is meshspeed.moe.utils
        assert deepspeed.moe.sharded_moe is sharded_moe
        assert deepspeed.moe.experts.Experts.__name__ == "Experts"  # attribute, not imported
    finally:
        uninstall()
