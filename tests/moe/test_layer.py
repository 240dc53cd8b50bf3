"""meshspeed.moe.layer.MoE on one process: DeepSpeed's module tree, parameter marks and
copies; validation; the forward against a per-token loop over the gate's routing
(capacity and dropless, top-1 and top-2); the residual variant; the z-loss; the two
token exchanges of dispatch.py agreeing with each other when nothing drops."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from meshspeed.moe import dispatch
from meshspeed.moe.experts import Experts
from meshspeed.moe.gating import Gate
from meshspeed.moe.layer import MoE, MOELayer
from meshspeed.moe.utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer

torch.set_num_threads(1)
M = 8


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(M, 16), nn.GELU(), nn.Linear(16, M))


def _distinct(layer: MoE, seed: int = 5) -> MoE:
    """Redraw every parameter, so that no two experts are alike."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return layer


def _experts(layer: MoE):
    return layer.deepspeed_moe.experts.deepspeed_experts


# -- module tree, marks, copies -----------------------------------------------------------------


def test_module_tree_and_state_dict_keys_are_deepspeeds():
    moe = MoE(M, _mlp(), num_experts=4, use_residual=True)
    assert isinstance(moe.deepspeed_moe, MOELayer)
    assert isinstance(moe.deepspeed_moe.gate, Gate) and isinstance(moe.deepspeed_moe.experts, Experts)
    wg = moe.deepspeed_moe.gate.wg
    assert isinstance(wg, nn.Linear) and wg.bias is None and wg.weight.shape == (4, M)
    assert isinstance(_experts(moe), nn.ModuleList) and len(_experts(moe)) == 4
    # DeepSpeed 0.19.8's MoE(8, Sequential(Linear, GELU, Linear), num_experts=4,
    # use_residual=True).state_dict().keys(), in its order
    expert_keys = [f"deepspeed_moe.experts.deepspeed_experts.{i}.{j}.{t}"
                   for i in range(4) for j in (0, 2) for t in ("weight", "bias")]
    assert list(moe.state_dict()) == [
        "deepspeed_moe.gate.wg.weight", *expert_keys, "mlp.0.weight", "mlp.0.bias",
        "mlp.2.weight", "mlp.2.bias", "coefficient.weight", "coefficient.bias"]
    assert (moe.ep_size, moe.num_experts, moe.num_local_experts, moe.expert_group_name) == (
        1, 4, 4, "ep_size_1")


def test_each_rank_holds_num_experts_over_ep_size_marked_copies():
    moe = MoE(M, _mlp(), num_experts=8, ep_size=4, use_residual=True)
    assert len(_experts(moe)) == 2 and moe.deepspeed_moe.num_local_experts == 2
    for p in _experts(moe).parameters():
        assert p.allreduce is False and p.group_name == "ep_size_4" and is_moe_param(p)
    dense = [moe.deepspeed_moe.gate.wg.weight, *moe.mlp.parameters(), *moe.coefficient.parameters()]
    assert not any(is_moe_param(p) for p in dense)
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(moe.parameters()), "lr": 0.1})
    assert [(g.get("name"), len(g["params"]), g.get("moe", False)) for g in groups] == [
        (None, len(dense), False), ("ep_size_4", 8, True)]


def test_copies_start_as_the_given_expert_and_are_independent():
    expert = _mlp()
    moe = MoE(M, expert, num_experts=2, use_residual=True)
    first, second = _experts(moe)
    for a, b, given in zip(first.parameters(), second.parameters(), expert.parameters()):
        assert torch.equal(a, given) and torch.equal(b, given)  # deep copies, as in DeepSpeed
        assert a.data_ptr() != b.data_ptr() != given.data_ptr()
    with torch.no_grad():
        first[0].weight.add_(1.0)
    assert not torch.equal(first[0].weight, second[0].weight)
    assert moe.mlp is expert  # DeepSpeed keeps the given module as the residual's dense MLP
    assert not any(is_moe_param(p) for p in expert.parameters())


# -- validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"num_experts": 6, "ep_size": 4}, "num_experts=6 is not divisible by ep_size=4"),
    ({"num_experts": 0}, "num_experts=0, ep_size=1; both must be >= 1"),
    ({"num_experts": 4, "k": 3}, "k=3 is not supported; use k=1 (top-1) or k=2"),
    ({"num_experts": 1, "k": 2}, "k=2 is larger than num_experts=1"),
    ({"num_experts": 4, "noisy_gate_policy": "Gaussian"}, "noisy_gate_policy='Gaussian' is not one of"),
    ({"num_experts": 4, "capacity_factor": 0.0}, "capacity_factor=0.0: it must be > 0"),
])
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        MoE(M, _mlp(), **kwargs)


def test_expert_parallel_layer_without_a_group_says_what_to_do():
    moe = MoE(M, _mlp(), num_experts=4, ep_size=2)
    with pytest.raises(RuntimeError, match="call meshspeed.initialize first .* or moe.set_expert_group"):
        moe(torch.randn(3, M))
    with pytest.raises(RuntimeError, match="meshspeed layers do not create process groups"):
        moe.set_deepspeed_parallelism()
    with pytest.raises(ValueError, match="ep_size=2 needs an expert-parallel group of 2 ranks"):
        moe.set_expert_group(None)
    MoE(M, _mlp(), num_experts=4).set_deepspeed_parallelism()  # ep_size=1: nothing to hand over


def test_an_expert_that_changes_the_shape_is_named():
    moe = MoE(M, nn.Linear(M, 2 * M), num_experts=2)
    with pytest.raises(ValueError, match=r"local expert 0 mapped \(\d+, 8\) to \(\d+, 16\)"):
        moe(torch.randn(4, M))


# -- forward ------------------------------------------------------------------------------------


def _loop_reference(moe: MoE, x: torch.Tensor, seed: int, used_token=None) -> torch.Tensor:
    """Per token: the sum over its kept choices of weight * expert(token), with the gate's
    routing under the same seed."""
    torch.manual_seed(seed)
    routing = moe.deepspeed_moe.gate(x, used_token)
    out = torch.zeros_like(x)
    for s in range(x.shape[0]):
        for j in range(routing.slot.shape[1]):
            if routing.slot[s, j] >= 0:
                expert = _experts(moe)[int(routing.expert_index[s, j])]
                out[s] += routing.weight[s, j] * expert(x[s:s + 1])[0]
    return out


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize(("mode", "options"), [
    ("ample", {"capacity_factor": 4.0}),
    ("binding", {"capacity_factor": 0.5, "min_capacity": 1}),
    ("dropless", {"drop_tokens": False}),
])
def test_forward_is_the_gate_weighted_mix_of_each_tokens_experts(k, mode, options):
    moe = _distinct(MoE(M, _mlp(), num_experts=4, k=k, **options))
    x = torch.randn(2, 6, M, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(3)
    out, l_aux, counts = moe(x)
    assert out.shape == x.shape and l_aux.shape == () and l_aux.requires_grad
    assert counts.shape == (4,) and int(counts.sum()) == 12 * k
    assert_close(out, _loop_reference(moe, x.view(12, M), 3).view(2, 6, M), atol=1e-6, rtol=1e-5)
    assert moe.deepspeed_moe.l_aux is l_aux and moe.deepspeed_moe.exp_counts is counts


@pytest.mark.parametrize("drop_tokens", [True, False])
def test_used_token_in_the_inputs_leading_shape_leaves_tokens_unrouted(drop_tokens):
    moe = _distinct(MoE(M, _mlp(), num_experts=2, capacity_factor=4.0, drop_tokens=drop_tokens))
    x = torch.randn(2, 3, M)
    used = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 1.0]])
    torch.manual_seed(0)
    out, _, counts = moe(x, used)
    assert int(counts.sum()) == 4 and (out[used == 0] == 0).all()
    assert_close(out.view(6, M), _loop_reference(moe, x.view(6, M), 0, used.view(6)))


def test_residual_moe_mixes_the_experts_and_the_dense_mlp_by_coefficient():
    moe = _distinct(MoE(M, _mlp(), num_experts=4, use_residual=True, capacity_factor=4.0))
    x = torch.randn(5, M)
    torch.manual_seed(0)
    out, _, _ = moe(x)
    torch.manual_seed(0)
    sparse = moe.deepspeed_moe(x)
    coef = torch.softmax(moe.coefficient(x), dim=-1)
    assert_close(out, sparse * coef[:, :1] + moe.mlp(x) * coef[:, 1:])


def test_z_loss_is_kept_and_added_to_l_aux_with_a_coefficient():
    x = torch.randn(6, M)
    plain = _distinct(MoE(M, _mlp(), num_experts=4))
    weighted = _distinct(MoE(M, _mlp(), num_experts=4, z_loss_coef=0.1))
    torch.manual_seed(0)
    _, l_plain, _ = plain(x)
    torch.manual_seed(0)
    _, l_weighted, _ = weighted(x)
    logits = x @ plain.deepspeed_moe.gate.wg.weight.T
    z = torch.logsumexp(logits, dim=1).square().mean()
    assert_close(plain.z_loss, z) and assert_close(weighted.z_loss, z)
    assert_close(l_weighted, l_plain + 0.1 * z)
    l_weighted.backward()
    assert plain.z_loss.requires_grad and weighted.deepspeed_moe.gate.wg.weight.grad is not None


def test_an_expert_returning_a_tuple_is_cut_to_its_first_element():
    class WithBias(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(M, M)

        def forward(self, x):
            return self.linear(x), self.linear.bias

    moe = MoE(M, WithBias(), num_experts=2, capacity_factor=4.0)
    out, _, _ = moe(torch.randn(3, M))
    assert out.shape == (3, M)


def test_bfloat16_tokens_and_experts_give_bfloat16_output():
    moe = MoE(M, _mlp(), num_experts=2, drop_tokens=False).to(torch.bfloat16)
    out, l_aux, _ = moe(torch.randn(4, M, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16 and l_aux.dtype == torch.float32


# -- the two exchanges on one process ------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2])
def test_capacity_and_dropless_exchanges_agree_when_nothing_drops(k):
    moe = _distinct(MoE(M, _mlp(), num_experts=4, k=k))
    x = torch.randn(7, M, requires_grad=True)
    # A raised capacity keeps a routing valid (Routing's contract): room for every choice.
    routing = dataclasses.replace(moe.deepspeed_moe.gate(x), capacity=7 * k)
    experts = moe.deepspeed_moe.experts
    padded = dispatch.exchange_capacity(routing, x, experts)
    exact = dispatch.exchange_dropless(routing, x, experts)
    assert_close(exact, padded)
    params = [x, moe.deepspeed_moe.gate.wg.weight, *experts.parameters()]
    grads = torch.autograd.grad(exact.square().sum(), params, retain_graph=True)  # shared gate
    want = torch.autograd.grad(padded.square().sum(), params)
    for g, w in zip(grads, want):
        assert_close(g, w)


def test_dropless_with_no_tokens_returns_an_empty_output():
    moe = MoE(M, _mlp(), num_experts=4, k=2, drop_tokens=False)
    x = torch.randn(0, M, requires_grad=True)
    out, _, counts = moe(x)
    out.sum().backward()
    assert out.shape == (0, M) and counts.tolist() == [0, 0, 0, 0] and x.grad.shape == (0, M)
    assert all(p.grad is not None for p in _experts(moe).parameters())  # every expert ran
