"""meshspeed.moe.gating: hand-computed routings, a slow loop reference, and the invariants of
capacity, random token selection, dropless routing, the losses and dispatch/combine.

One process, tiny tensors. The reference below is written from the semantics (GShard /
Switch / DeepSpeed's sharded_moe), not from the implementation under test.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from meshspeed.moe import gating
from meshspeed.moe.gating import Gate, Routing, capacity, top1_routing, top2_routing

torch.set_num_threads(1)


# -- a slow, obvious reference ------------------------------------------------------------------


def reference_top1(logits, cap, *, noise=None, priority=None, used=None, drop=True):
    """Loop version: (expert [S], slot [S], weight [S], counts [E])."""
    logits = logits.detach()
    num_tokens, num_experts = logits.shape
    gates = torch.softmax(logits, dim=1)
    scores = logits + noise if noise is not None else gates
    expert = [int(scores[s].argmax()) for s in range(num_tokens)]
    routed = [s for s in range(num_tokens) if used is None or used[s]]
    counts = [sum(expert[s] == e for s in routed) for e in range(num_experts)]
    kept = set()
    for e in range(num_experts):
        queue = [s for s in routed if expert[s] == e]
        if priority is not None:
            queue = sorted(queue, key=lambda s, e=e: -float(priority[s, e]))
        kept.update(queue[:cap] if drop else queue)
    slot, weight, filled = [-1] * num_tokens, [0.0] * num_tokens, [0] * num_experts
    for s in sorted(kept):
        slot[s], filled[expert[s]] = filled[expert[s]], filled[expert[s]] + 1
        weight[s] = float(gates[s, expert[s]])
    return expert, slot, weight, counts


def reference_top2(logits, cap, *, noise=None, drop=True):
    """Loop version: (experts [S][2], slots [S][2], weights [S][2], counts [E])."""
    logits = logits.detach()
    num_tokens, num_experts = logits.shape
    gates = torch.softmax(logits, dim=1)
    scores = logits + noise if noise is not None else logits
    first = [int(gates[s].argmax()) for s in range(num_tokens)]
    second = []
    for s in range(num_tokens):
        others = [e for e in range(num_experts) if e != first[s]]
        second.append(max(others, key=lambda e, s=s: (float(scores[s, e]), -e)))
    place, filled = {}, [0] * num_experts
    for choice in (first, second):  # all first choices of an expert, then its second choices
        for s in range(num_tokens):
            place[s, choice is second] = filled[choice[s]]
            filled[choice[s]] += 1
    experts, slots, weights = [], [], []
    for s in range(num_tokens):
        pair = (first[s], second[s])
        slot = [place[s, j] if not drop or place[s, j] < cap else -1 for j in (0, 1)]
        g = [float(gates[s, pair[j]]) if slot[j] >= 0 else 0.0 for j in (0, 1)]
        denom = max(g[0] + g[1], torch.finfo(torch.float32).eps)
        experts.append(list(pair))
        slots.append(slot)
        weights.append([g[0] / denom, g[1] / denom])
    return experts, slots, weights, filled


def assert_routing(r: Routing, expert, slot, weight, counts, cap):
    k = r.slot.shape[1]
    shape = (-1, k)
    assert r.capacity == cap
    assert r.expert_index.tolist() == torch.tensor(expert).reshape(shape).tolist()
    assert r.slot.tolist() == torch.tensor(slot).reshape(shape).tolist()
    assert_close(r.weight, torch.tensor(weight, dtype=torch.float32).reshape(shape))
    assert r.exp_counts.tolist() == list(counts)
    assert r.exp_counts.dtype == torch.int64


def probs(rows):
    """Logits whose softmax is exactly the given rows (up to rounding)."""
    return torch.tensor(rows, dtype=torch.float32).log()


# -- capacity -----------------------------------------------------------------------------------


def test_capacity_formula():
    assert capacity(8, 4, 1.0) == 2
    assert capacity(9, 4, 1.0) == 3  # ceil
    assert capacity(8, 4, 1.0, k=2) == 4  # top-2: two slots per token
    assert capacity(8, 4, 0.5, k=2) == 2
    assert capacity(4, 8, 1.0, 4) == 4  # min_capacity is a floor
    assert capacity(64, 4, 1.25, 4) == 20
    assert capacity(1, 4, 0.01) == 1  # any positive share rounds up to one slot
    assert capacity(0, 4, 1.0) == 0
    assert capacity(0, 4, 1.0, 3) == 3


def test_capacity_rounds_in_float32_as_deepspeed():
    # Note [capacity in float32]: 25/2 * 1.2 is 15.0 in float64 but 15.000000596 in float32
    # (1.2 rounds up), so DeepSpeed gives 16; and 35/3 * 1.2 is 13.999999999999998 in
    # float64, so float64 would give 14 where DeepSpeed gives 15.
    assert math.ceil(25 / 2 * 1.2) == 15 and capacity(25, 2, 1.2) == 16
    assert math.ceil(35 / 3 * 1.2) == 14 and capacity(35, 3, 1.2) == 15


@pytest.mark.parametrize("factor", [0, -1.0])
def test_capacity_rejects_nonpositive_factor(factor):
    with pytest.raises(ValueError, match=f"capacity_factor={factor}: it must be > 0"):
        capacity(8, 4, factor)


def test_capacity_rejects_no_experts():
    with pytest.raises(ValueError, match="num_experts=0"):
        capacity(8, 0, 1.0)


# -- top-1 --------------------------------------------------------------------------------------

TOP1_ROWS = [[0.5, 0.25, 0.25], [0.6, 0.2, 0.2], [0.7, 0.1, 0.2],
             [0.2, 0.5, 0.3], [0.1, 0.3, 0.6], [0.25, 0.25, 0.5]]  # experts 0 0 0 1 2 2


def test_top1_hand_case():
    # 6 tokens, 3 experts, factor 1: capacity 2; expert 0 gets three tokens, keeps the first two.
    r = top1_routing(probs(TOP1_ROWS), 1.0, 0, use_rts=False)
    assert_routing(r, expert=[0, 0, 0, 1, 2, 2], slot=[0, 1, -1, 0, 0, 1],
                   weight=[0.5, 0.6, 0.0, 0.5, 0.6, 0.5], counts=[3, 1, 2], cap=2)
    # l_aux = E * sum_e mean_gate_e * fraction_e = 3 * (2.35*3 + 1.6*1 + 2.05*2) / 36
    assert_close(r.l_aux, torch.tensor(1.0625))


def test_top1_dropless_hand_case():
    r = top1_routing(probs(TOP1_ROWS), 1.0, 100, drop_tokens=False, use_rts=False)
    assert_routing(r, expert=[0, 0, 0, 1, 2, 2], slot=[0, 1, 2, 0, 0, 1],
                   weight=[0.5, 0.6, 0.7, 0.5, 0.6, 0.5], counts=[3, 1, 2], cap=3)


def test_top1_used_token():
    used = torch.tensor([1, 0, 1, 1, 0, 1])
    r = top1_routing(probs(TOP1_ROWS), 1.0, 0, use_rts=False, used_token=used)
    assert_routing(r, expert=[0, 0, 0, 1, 2, 2], slot=[0, -1, 1, 0, -1, 0],
                   weight=[0.5, 0.0, 0.7, 0.5, 0.0, 0.5], counts=[2, 1, 1], cap=2)
    # the mean gate is over all six tokens, the fraction over the routed ones
    gates = torch.tensor(TOP1_ROWS)
    assert_close(r.l_aux, 3 * (gates.mean(0) * torch.tensor([2, 1, 1]) / 6).sum())


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("drop", [True, False])
def test_top1_matches_reference(seed, drop):
    torch.manual_seed(seed)
    logits = torch.randn(24, 4)
    logits[:, 1] += 1.0  # expert 1 overflows
    used = torch.rand(24) > 0.2
    cap = capacity(24, 4, 1.0, 2) if drop else None
    r = top1_routing(logits, 1.0, 2, use_rts=False, drop_tokens=drop, used_token=used)
    expert, slot, weight, counts = reference_top1(logits, cap, used=used, drop=drop)
    assert_routing(r, expert, slot, weight, counts, cap if drop else max(counts))


@pytest.mark.parametrize("drop", [True, False])
def test_top1_random_draws_in_documented_order(drop):
    # Note [random numbers in gating]: RSample noise first, then the RTS priorities.
    logits = torch.randn(20, 3, generator=torch.Generator().manual_seed(5))
    logits[:, 0] += 1.5
    torch.manual_seed(11)
    noise = gating.gumbel_noise((20, 3))
    priority = torch.rand(20, 3)
    after = torch.rand(4)
    torch.manual_seed(11)
    r = top1_routing(logits, 1.0, 0, rsample=True, use_rts=True, drop_tokens=drop)
    assert torch.equal(torch.rand(4), after)  # exactly those two draws were consumed
    cap = 7 if drop else None
    expert, slot, weight, counts = reference_top1(logits, cap, noise=noise, priority=priority,
                                                  drop=drop)
    assert_routing(r, expert, slot, weight, counts, cap if drop else max(counts))


def test_gumbel_noise_is_minus_log_minus_log_uniform():
    torch.manual_seed(3)
    g = gating.gumbel_noise((50, 4))
    torch.manual_seed(3)
    u = torch.rand(50, 4)
    assert g.dtype == torch.float32
    # u is kept inside [tiny, 1 - eps]; -log(-log(u)) is steep near u = 1, hence rtol.
    assert_close(g, -torch.log(-torch.log(u)), rtol=1e-4, atol=1e-5)


# -- random token selection ---------------------------------------------------------------------


def _overfull(num_tokens=16):
    """All tokens prefer expert 0 of 2; factor 0.5 gives capacity 4."""
    return torch.stack([torch.linspace(1.0, 2.0, num_tokens), torch.zeros(num_tokens)], dim=1)


def test_without_rts_an_overfull_expert_keeps_its_first_tokens():
    r = top1_routing(_overfull(), 0.5, 0, use_rts=False)
    assert r.capacity == 4
    assert r.slot[:, 0].tolist() == [0, 1, 2, 3] + [-1] * 12


def test_rts_keeps_exactly_capacity_tokens_a_random_subset():
    subsets = set()
    for seed in range(8):
        torch.manual_seed(seed)
        r = top1_routing(_overfull(), 0.5, 0, use_rts=True)
        kept = torch.nonzero(r.kept[:, 0]).flatten().tolist()
        assert len(kept) == r.capacity == 4
        assert r.slot[kept, 0].tolist() == [0, 1, 2, 3]  # kept tokens take slots in token order
        assert (r.weight[r.slot[:, 0] < 0] == 0).all()
        subsets.add(tuple(kept))
    assert len(subsets) > 1  # different seeds, different subsets


def test_rts_same_seed_same_subset_and_generator_leaves_global_rng_alone():
    torch.manual_seed(4)
    a = top1_routing(_overfull(), 0.5, 0)
    state = torch.get_rng_state()
    b = top1_routing(_overfull(), 0.5, 0, generator=torch.Generator().manual_seed(4))
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(a.slot, b.slot)


# -- top-2 --------------------------------------------------------------------------------------

TOP2_ROWS = [[0.5, 0.3, 0.2], [0.6, 0.1, 0.3], [0.3, 0.5, 0.2],
             [0.4, 0.35, 0.25], [0.3, 0.1, 0.6], [0.1, 0.6, 0.3]]


def test_top2_hand_case():
    # capacity = ceil(6/3 * 0.5 * 2) = 2. First choices 0 0 1 0 2 1, second 1 2 0 1 0 2.
    # Expert 0: first t0 t1 (t3 at place 2 dropped), seconds t2 t4 at places 3, 4 dropped.
    # Expert 1: first t2 t5; seconds t0 t3 at places 2, 3 dropped.
    # Expert 2: first t4; seconds t1 at place 1 kept, t5 at place 2 dropped.
    r = top2_routing(probs(TOP2_ROWS), 0.5, 0, second_expert_sampling=False)
    assert_routing(r, expert=[[0, 1], [0, 2], [1, 0], [0, 1], [2, 0], [1, 2]],
                   slot=[[0, -1], [1, 1], [0, -1], [-1, -1], [0, -1], [1, -1]],
                   weight=[[1, 0], [2 / 3, 1 / 3], [1, 0], [0, 0], [1, 0], [1, 0]],
                   counts=[5, 4, 3], cap=2)
    # l_aux from the first choices: 3 * (2.2*3 + 1.95*2 + 1.85*1) / 36
    assert_close(r.l_aux, torch.tensor(37.05 / 36))


def test_top2_dropless_hand_case():
    r = top2_routing(probs(TOP2_ROWS), 0.5, 100, drop_tokens=False, second_expert_sampling=False)
    assert_routing(r, expert=[[0, 1], [0, 2], [1, 0], [0, 1], [2, 0], [1, 2]],
                   slot=[[0, 2], [1, 1], [0, 3], [2, 3], [0, 4], [1, 2]],
                   weight=[[0.5 / 0.8, 0.3 / 0.8], [0.6 / 0.9, 0.3 / 0.9], [0.5 / 0.8, 0.3 / 0.8],
                           [0.4 / 0.75, 0.35 / 0.75], [0.6 / 0.9, 0.3 / 0.9], [0.6 / 0.9, 0.3 / 0.9]],
                   counts=[5, 4, 3], cap=5)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("drop", [True, False])
def test_top2_matches_reference(seed, drop):
    torch.manual_seed(seed)
    logits = torch.randn(20, 5)
    logits[:, 2] += 1.0
    cap = capacity(20, 5, 1.0, 0, k=2)
    r = top2_routing(logits, 1.0, 0, drop_tokens=drop, second_expert_sampling=False)
    experts, slots, weights, counts = reference_top2(logits, cap, drop=drop)
    assert_routing(r, experts, slots, weights, counts, cap if drop else max(counts))


def test_top2_second_expert_sampling_draws_gumbel_noise():
    logits = torch.randn(16, 4, generator=torch.Generator().manual_seed(2))
    torch.manual_seed(8)
    noise = gating.gumbel_noise((16, 4))
    torch.manual_seed(8)
    r = top2_routing(logits, 1.0, 0)
    experts, slots, weights, counts = reference_top2(logits, 8, noise=noise)
    assert_routing(r, experts, slots, weights, counts, 8)
    assert (r.expert_index[:, 0] != r.expert_index[:, 1]).all()


def test_top2_used_token():
    used = torch.tensor([1, 1, 0, 1, 1, 1])
    r = top2_routing(probs(TOP2_ROWS), 0.5, 0, second_expert_sampling=False, used_token=used)
    assert r.slot[2].tolist() == [-1, -1] and r.weight[2].tolist() == [0, 0]
    assert r.exp_counts.tolist() == [4, 3, 3]  # t2's choices (1 then 0) are not counted


# -- dropless and the capacity group ------------------------------------------------------------


@pytest.mark.parametrize("route", [top1_routing, top2_routing])
def test_dropless_keeps_every_token(route):
    torch.manual_seed(0)
    logits = torch.randn(30, 4)
    logits[:, 3] += 2.0
    r = route(logits, 0.25, 50, drop_tokens=False)
    assert r.capacity == int(r.exp_counts.max()) < 50  # min_capacity does not apply
    assert r.kept.all()
    for e in range(4):
        slots = r.slot[r.expert_index == e]
        assert sorted(slots.tolist()) == list(range(int(r.exp_counts[e])))


def test_dropless_capacity_is_max_reduced_over_the_group(monkeypatch):
    calls = []

    def fake_all_reduce(tensor, group=None, op="sum"):
        calls.append((group, op, int(tensor)))
        tensor.fill_(9)  # another rank's expert received 9 tokens

    monkeypatch.setattr(gating.comm, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(gating.comm, "all_reduce", fake_all_reduce)
    group = object()
    r = top1_routing(probs(TOP1_ROWS), 1.0, 0, drop_tokens=False, capacity_group=group)
    assert calls == [(group, "max", 3)]
    assert r.capacity == 9 and r.kept.all()
    assert r.dispatch(torch.ones(6, 2)).shape == (3, 9, 2)
    top1_routing(probs(TOP1_ROWS), 1.0, 0, capacity_group=group)  # dropping: no collective
    assert len(calls) == 1


# -- losses -------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2])
def test_uniform_router_has_l_aux_one_and_z_loss_log_e_squared(k):
    gate = Gate(8, 4, k=k)
    torch.nn.init.zeros_(gate.wg.weight)
    r = gate(torch.randn(12, 8))
    assert_close(r.l_aux, torch.tensor(1.0))
    assert_close(r.z_loss, torch.tensor(math.log(4) ** 2))


def test_z_loss_value():
    logits = torch.tensor([[0.0, math.log(3.0)], [1.0, 1.0]])
    r = top1_routing(logits, 1.0, 0)
    assert_close(r.z_loss, torch.tensor((math.log(4) ** 2 + (1 + math.log(2)) ** 2) / 2))


@pytest.mark.parametrize("k", [1, 2])
def test_losses_and_combine_weights_carry_gradient_to_wg(k):
    torch.manual_seed(0)
    gate = Gate(6, 3, k=k)
    x = torch.randn(10, 6)
    for loss in ("l_aux", "z_loss", "combine"):
        gate.zero_grad()
        r = gate(x)
        value = r.combine(r.dispatch(x)).sum() if loss == "combine" else getattr(r, loss)
        value.backward()
        grad = gate.wg.weight.grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0, loss


# -- dispatch / combine -------------------------------------------------------------------------


@pytest.mark.parametrize("route", [top1_routing, top2_routing])
def test_dispatch_and_combine_equal_the_dense_einsum_form(route):
    torch.manual_seed(1)
    logits = torch.randn(12, 3, requires_grad=True)
    r = route(logits, 0.5, 0)
    assert not r.kept.all()  # some tokens are dropped
    x = torch.randn(12, 5)
    out = torch.randn(3, r.capacity, 5)
    weights, mask = r.dense()
    assert weights.shape == mask.shape == (12, 3, r.capacity) and mask.dtype == torch.bool
    assert torch.equal(mask, weights != 0)
    assert_close(r.dispatch(x), torch.einsum("sec,sm->ecm", mask.float(), x))
    combined = r.combine(out)
    assert_close(combined, torch.einsum("sec,ecm->sm", weights, out))
    assert (combined[~r.kept.any(1)] == 0).all()  # tokens with no kept choice get zeros
    # the same gradient reaches the logits through either form
    (grad_index,) = torch.autograd.grad(combined.square().sum(), logits, retain_graph=True)
    dense = torch.einsum("sec,ecm->sm", weights, out).square().sum()
    (grad_dense,) = torch.autograd.grad(dense, logits)
    assert_close(grad_index, grad_dense)


def test_top2_round_trip_through_identity_experts_returns_the_token():
    torch.manual_seed(2)
    r = top2_routing(torch.randn(16, 4), 0.75, 0)
    x = torch.randn(16, 3)
    y = r.combine(r.dispatch(x))
    some = r.kept.any(1)
    assert_close(y[some], x[some])  # the kept weights of a token sum to 1
    assert (y[~some] == 0).all()


def test_dispatch_leaves_empty_slots_zero_and_is_differentiable():
    r = top1_routing(probs(TOP1_ROWS), 1.0, 4, use_rts=False)  # capacity 4, experts fill 2 1 2
    x = torch.randn(6, 2, requires_grad=True)
    buffer = r.dispatch(x)
    assert buffer.shape == (3, 4, 2)
    assert torch.equal(buffer[0, :3], x[[0, 1, 2]].detach()) and (buffer[0, 3] == 0).all()
    assert (buffer[1, 1:] == 0).all() and (buffer[2, 2:] == 0).all()
    buffer.sum().backward()
    assert x.grad.tolist() == [[1.0, 1.0]] * 6


def test_combine_does_not_leak_nan_from_slot_zero_into_dropped_tokens():
    r = Routing(expert_index=torch.tensor([[1], [1]]), slot=torch.tensor([[0], [-1]]),
                weight=torch.tensor([[0.5], [0.0]]), exp_counts=torch.tensor([0, 2]),
                capacity=1, l_aux=torch.tensor(0.0), z_loss=torch.tensor(0.0))
    out = torch.tensor([[[float("nan")]], [[4.0]]])  # expert 0, slot 0: empty, garbage
    assert r.combine(out).tolist() == [[2.0], [0.0]]
    assert r.flat_slot.tolist() == [[1], [-1]]


def test_combine_sums_in_float32_and_returns_the_expert_dtype():
    r = top2_routing(torch.randn(8, 4), 1.0, 0)
    out = torch.randn(4, r.capacity, 3).to(torch.bfloat16)
    assert r.weight.dtype == torch.float32
    y = r.combine(out)
    assert y.dtype == torch.bfloat16
    assert_close(y, torch.einsum("sec,ecm->sm", r.dense()[0], out.float()).to(torch.bfloat16))


# -- the Gate module ----------------------------------------------------------------------------


def test_gate_wg_matches_deepspeed_layout_and_routes_in_float32():
    gate = Gate(8, 4, k=2)
    assert list(gate.state_dict()) == ["wg.weight"]
    assert gate.wg.weight.shape == (4, 8) and gate.wg.bias is None
    x = torch.randn(10, 8).to(torch.bfloat16)
    torch.manual_seed(0)
    r = gate(x)
    torch.manual_seed(0)
    expected = top2_routing(F.linear(x.float(), gate.wg.weight), 1.0, 4)
    assert r.weight.dtype == torch.float32
    assert torch.equal(r.slot, expected.slot) and torch.equal(r.weight, expected.weight)


def test_gate_capacity_factor_in_training_and_eval():
    gate = Gate(4, 2, capacity_factor=1.0, eval_capacity_factor=2.0, min_capacity=0)
    x = torch.randn(8, 4)
    assert gate(x).capacity == 4
    assert gate.eval()(x).capacity == 8


def test_gate_jitter_scales_the_router_input_in_training_only():
    torch.manual_seed(0)
    gate = Gate(5, 3, noisy_gate_policy="Jitter", use_rts=True, min_capacity=0)
    x = torch.randn(9, 5)
    torch.manual_seed(6)
    u = torch.rand(9, 5)          # 1. the jitter
    priority = torch.rand(9, 3)   # 2. the RTS priorities
    torch.manual_seed(6)
    r = gate(x)
    logits = F.linear(x * (0.99 + u * 0.02), gate.wg.weight)
    expert, slot, weight, counts = reference_top1(logits, 3, priority=priority)
    assert_routing(r, expert, slot, weight, counts, 3)
    assert_close(gating.jitter(torch.ones(1000), generator=torch.Generator().manual_seed(0)),
                 torch.ones(1000), atol=0.01, rtol=0)


@pytest.mark.parametrize("policy", ["Jitter", "RSample"])
def test_gate_noise_policies_draw_nothing_in_eval(policy):
    gate = Gate(5, 3, noisy_gate_policy=policy, use_rts=False).eval()
    state = torch.get_rng_state()
    gate(torch.randn(6, 5, generator=torch.Generator().manual_seed(0)))
    assert torch.equal(torch.get_rng_state(), state)


def test_gate_rsample_with_top2_has_no_effect_and_warns_once(caplog):
    # DeepSpeed 0.19.8 accepts it and passes the policy to top-1 gating only; scripts (the
    # cifar10 example's --noisy-gate-policy RSample --top-k 2) rely on that.
    gating._warn_once_on_rank_zero.cache_clear()
    with caplog.at_level("WARNING", logger="meshspeed"):
        noisy = Gate(5, 4, k=2, noisy_gate_policy="RSample")
        Gate(5, 4, k=2, noisy_gate_policy="RSample")  # a second layer: no second warning
    warnings = [r.getMessage() for r in caplog.records if "RSample" in r.getMessage()]
    assert len(warnings) == 1 and "has no effect with k=2" in warnings[0]
    plain = Gate(5, 4, k=2)
    plain.load_state_dict(noisy.state_dict())
    x = torch.randn(9, 5, generator=torch.Generator().manual_seed(0))
    routings, states = [], []
    for gate in (noisy, plain):
        torch.manual_seed(3)
        routings.append(gate.train()(x))
        states.append(torch.get_rng_state())
    for field in ("expert_index", "slot", "weight"):
        assert torch.equal(getattr(routings[0], field), getattr(routings[1], field))
    assert torch.equal(states[0], states[1])  # the same draws: the second expert's noise only


def test_gate_none_string_policy_is_none():
    assert Gate(4, 2, noisy_gate_policy="None").noisy_gate_policy is None


@pytest.mark.parametrize("kwargs, message", [
    ({"k": 0}, "k=0 is not supported; k=1 .*, k=2 .* or any larger int .* is"),
    ({"k": 1.5}, "k=1.5 is not supported"),
    ({"num_experts": 1, "k": 2}, "k=2 is larger than num_experts=1"),
    ({"noisy_gate_policy": "Gumbel"}, "'Gumbel' is not one of None, 'None', 'Jitter', 'RSample'"),
    ({"capacity_factor": 0.0}, "capacity_factor=0.0: it must be > 0"),
    ({"eval_capacity_factor": -1.0}, "eval_capacity_factor=-1.0: it must be > 0"),
    ({"min_capacity": -1}, "min_capacity=-1"),
])
def test_gate_rejects_bad_arguments(kwargs, message):
    args = {"model_dim": 4, "num_experts": 4, **kwargs}
    with pytest.raises(ValueError, match=message):
        Gate(**args)


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match=r"x has shape \(2, 3, 4\); expected \[tokens, 4\]"):
        Gate(4, 2)(torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match="1 expert\\(s\\) for k=2"):
        top2_routing(torch.randn(4, 1))
    with pytest.raises(ValueError, match=r"used_token has shape \(3,\); expected \[4\]"):
        top1_routing(torch.randn(4, 2), used_token=torch.ones(3))
    r = top1_routing(torch.randn(4, 2), 1.0, 0)
    with pytest.raises(ValueError, match="Routing.dispatch: x has shape"):
        r.dispatch(torch.randn(5, 3))
    with pytest.raises(ValueError, match="Routing.combine: expert_out has shape"):
        r.combine(torch.randn(2, r.capacity + 1, 3))


@pytest.mark.parametrize("k", [1, 2])
def test_no_tokens_give_zero_losses_not_nan(k):
    """A rank with no tokens: l_aux and z_loss are 0 with a gradient path to wg (a NaN
    there would spread through the data-parallel gradient average)."""
    gate = Gate(8, 4, k=k)
    routing = gate(torch.zeros(0, 8))
    assert routing.l_aux.item() == 0.0 and routing.z_loss.item() == 0.0
    (routing.l_aux + routing.z_loss).backward()
    assert gate.wg.weight.grad is not None and torch.isfinite(gate.wg.weight.grad).all()
