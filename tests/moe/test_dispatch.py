"""MoE with expert parallelism on 2 and 4 gloo ranks against the same layer with every
expert local, on one process: outputs, l_aux, exp_counts, input, gate and expert
gradients; capacity that binds; experts no rank or only some ranks route to; ranks with
different token counts and with none, in both modes; bytes moved, against the formula.

The reference: every rank builds the full layer (ep_size=1) from one seed and routes its
own tokens with it, as the expert-parallel layer does (routing and capacity are per rank,
as in DeepSpeed); the ep layer copies the gate and its local experts from it. An expert
parameter's gradient in the ep layer is the sum over the ep group of the reference's
(Note [gradients of expert parameters] in meshspeed/moe/layer.py).

One run_distributed call per world size (`_results`) runs every case; the tests below
read its results. Parity failures come back as messages naming the case."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.testing import assert_close

from meshspeed import comm
from meshspeed.comm import ring_bytes
from meshspeed.moe.gating import capacity
from meshspeed.moe.layer import MoE
from meshspeed.testing import run_distributed, world_sizes

M, H = 8, 12  # model dim, expert hidden dim
TOL = {"atol": 1e-5, "rtol": 1e-5}


def _expert() -> nn.Module:
    return nn.Sequential(nn.Linear(M, H), nn.Tanh(), nn.Linear(H, M))


def _experts(layer):
    return layer.deepspeed_moe.experts.deepspeed_experts


def _layers(num_experts, ep, group, k, dead_expert=False, **options):
    """(reference with all experts local, ep layer with this rank's experts), same weights.
    Every parameter is redrawn so that no two experts are alike (a mix-up would show)."""
    torch.manual_seed(1234)
    full = MoE(M, _expert(), num_experts=num_experts, k=k, **options)
    g = torch.Generator().manual_seed(99)
    with torch.no_grad():
        for p in full.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.7)
        if dead_expert:  # inputs are positive: expert 0's logit is far below every other
            full.deepspeed_moe.gate.wg.weight[0] = -10.0
    layer = MoE(M, _expert(), num_experts=num_experts, ep_size=ep, k=k, **options)
    layer.set_expert_group(group)
    local, r = num_experts // ep, comm.get_rank(group)
    layer.deepspeed_moe.gate.load_state_dict(full.deepspeed_moe.gate.state_dict())
    for i in range(local):
        _experts(layer)[i].load_state_dict(_experts(full)[r * local + i].state_dict())
    return full, layer


def _step(layer, x, dy, seed, used_token=None):
    """Forward and backward of (out * dy).sum() + 0.3 * l_aux with the gate's random draws
    seeded; (out, l_aux, exp_counts, x.grad)."""
    torch.manual_seed(seed)
    x = x.clone().requires_grad_()
    out, l_aux, counts = layer(x, used_token)
    ((out * dy).sum() + 0.3 * l_aux).backward()
    return out.detach(), l_aux.detach(), counts, x.grad


def _grad(p):
    return torch.zeros_like(p) if p.grad is None else p.grad


def _parity(name, group, num_experts, k, sizes, dead_expert=None, shape=None, used=False,
            **options) -> tuple[list[str], dict]:
    """Failure messages of one case on this rank, and facts for the tests (tokens
    dropped, exp_counts). dead_expert "all": no rank routes to expert 0 (positive inputs,
    its gate row -10); "rank 0": rank 0 does not, the others send it their first choices
    (negative inputs)."""
    ep, rank, r = comm.get_world_size(group), comm.get_rank(), comm.get_rank(group)
    full, layer = _layers(num_experts, ep, group, k, dead_expert is not None, **options)
    g = torch.Generator().manual_seed(1000 + rank)
    num_tokens = sizes[rank]
    if dead_expert is None:
        x = torch.randn(num_tokens, M, generator=g)
    else:
        x = torch.rand(num_tokens, M, generator=g) + 0.1
        if dead_expert == "rank 0" and rank != 0:
            x = -x
    dy = torch.randn(num_tokens, M, generator=g)
    if shape is not None:
        x, dy = x.view(*shape, M), dy.view(*shape, M)
    used_token = (torch.rand(num_tokens, generator=g) > 0.3).float() if used else None
    want = _step(full, x, dy, seed=7 + rank, used_token=used_token)
    got = _step(layer, x, dy, seed=7 + rank, used_token=used_token)

    failures = []

    def check(what, g, w):
        try:
            assert_close(g, w, equal_nan=True, **TOL)
        except AssertionError as err:
            failures.append(f"{name} rank {rank}: {what}: {err}")

    for what, g, w in zip(("out", "l_aux", "exp_counts", "x.grad"), got, want):
        check(what, g, w)
    check("gate grad", layer.deepspeed_moe.gate.wg.weight.grad, full.deepspeed_moe.gate.wg.weight.grad)
    reference = torch.cat([_grad(p).reshape(-1) for p in _experts(full).parameters()])
    comm.all_reduce(reference, group=group)  # sum over the ep group
    per_expert = reference.numel() // num_experts
    mine = reference[r * per_expert * (num_experts // ep):(r + 1) * per_expert * (num_experts // ep)]
    check("expert grads", torch.cat([_grad(p).reshape(-1) for p in _experts(layer).parameters()]), mine)
    dropped = int((got[0].reshape(-1, M) == 0).all(dim=1).sum())
    return failures, {"dropped": dropped, "exp_counts": got[2].tolist(), "tokens": num_tokens}


def _groups(n):
    """[(ep, my group, its members)]: the world as one ep group, and at n = 4 also two ep
    groups of 2 ([0, 1], [2, 3]: consecutive ranks, as the mesh's ep axis)."""
    out = [(n, dist.group.WORLD, list(range(n)))]
    if n == 4:
        pairs = [[0, 1], [2, 3]]
        made = [dist.new_group(p) for p in pairs]
        mine = comm.get_rank() // 2
        out.append((2, made[mine], pairs[mine]))
    return out


def _cases(n) -> tuple[list[str], dict]:
    failures, facts = [], {}
    for ep, group, members in _groups(n):
        for num_experts in (ep, 2 * ep):
            for k in (1, 2):
                if k > num_experts:
                    continue
                tag = f"ep={ep} group={members} E={num_experts} k={k}"
                same, none = [6] * n, [0] * n
                uneven, empty = [3 + 5 * i for i in range(n)], [5] * (n - 1) + [0]
                dropless = {"drop_tokens": False}
                ample = {"capacity_factor": float(num_experts)}  # C = S * k: nothing can drop
                binding = {"capacity_factor": 0.5, "min_capacity": 1}
                cases = {
                    "ample": {"sizes": same, **ample},
                    "ample 3-d": {"sizes": same, "shape": (2, 3), **ample},
                    "ample dead expert": {"sizes": same, "dead_expert": "all", **ample},
                    "ample dead expert on rank 0": {"sizes": same, "dead_expert": "rank 0", **ample},
                    "binding": {"sizes": [10] * n, **binding},
                    "binding used_token": {"sizes": [10] * n, "used": True, **binding},
                    # different S per rank: different C, buffers padded to the largest
                    # (Note [one capacity over the ep group] in meshspeed/moe/layer.py)
                    "binding uneven": {"sizes": uneven, **binding},
                    "capacity empty rank": {"sizes": empty, "min_capacity": 0},  # C = 0 there
                    "capacity no tokens": {"sizes": none, "min_capacity": 0},  # C = 0 everywhere
                    "dropless uneven": {"sizes": uneven, **dropless},
                    "dropless dead expert": {"sizes": [4 + i for i in range(n)],
                                             "dead_expert": "all", **dropless},
                    "dropless dead expert on rank 0": {"sizes": [4 + i for i in range(n)],
                                                       "dead_expert": "rank 0", **dropless},
                    "dropless empty rank": {"sizes": empty, **dropless},
                    "dropless no tokens": {"sizes": none, **dropless},
                    "dropless used_token": {"sizes": [2 + 3 * i for i in range(n)], "used": True,
                                            **dropless},
                }
                if k == 2:  # DeepSpeed's top-2 ignores used_token; covered by gating tests
                    cases = {c: o for c, o in cases.items() if "used_token" not in c}
                if k == num_experts:  # every token goes to every expert: none can be idle
                    cases = {c: o for c, o in cases.items() if "dead expert" not in c}
                for case, options in cases.items():
                    f, fact = _parity(f"{tag} {case}", group, num_experts, k, **options)
                    failures += f
                    facts[(ep, num_experts, k, case)] = fact
    return failures, facts


# Bytes: S = 2E tokens per rank and capacity factor 1.5, so that C = ceil(S/E * 1.5 * k)
# = 3k is exact and the capacity buffer E*C*M is the formula S * k * 1.5 * M.
CF = 1.5


def _bytes(n) -> dict:
    """Bytes and calls of one forward and one backward at ep = n, E = 2n, k = 1 and 2:
    capacity mode with the same S everywhere and with S differing by rank, and dropless."""
    out = {}
    num_experts = 2 * n
    rank = comm.get_rank()
    modes = {"capacity": ({"capacity_factor": CF, "min_capacity": 1}, 2 * num_experts),
             "capacity uneven": ({"capacity_factor": CF, "min_capacity": 1}, 2 * num_experts + 4 * rank),
             "dropless": ({"drop_tokens": False}, 3 + 2 * rank)}
    for k in (1, 2):
        for mode, (options, num_tokens) in modes.items():
            _, layer = _layers(num_experts, n, dist.group.WORLD, k=k, **options)
            g = torch.Generator().manual_seed(rank)
            x = torch.randn(num_tokens, M, generator=g, requires_grad=True)
            with comm.CommCounter() as forward:
                y, l_aux, counts = layer(x)
            with comm.CommCounter() as backward:
                (y.square().sum() + l_aux).backward()
            out[mode, k] = {"forward": forward.summary(), "backward": backward.summary(),
                            "counts": counts.tolist(), "tokens": num_tokens}
    return out


def _errors(n) -> dict:
    if n != 2:
        return {}
    messages = {}
    try:
        MoE(M, _expert(), num_experts=4, ep_size=4).set_expert_group(dist.group.WORLD)
    except ValueError as err:
        messages["group size"] = str(err)
    return messages


def _body():
    torch.set_num_threads(1)
    n = comm.get_world_size()
    failures, facts = _cases(n)
    return {"failures": failures, "facts": facts, "bytes": _bytes(n), "errors": _errors(n)}


@functools.cache
def _results(n: int) -> list[dict]:
    return run_distributed(_body, n, timeout=600)


@world_sizes(2, 4)
def test_expert_parallel_layer_matches_all_experts_local(world_size):
    # ep = world (and ep = 2 groups at 4 ranks); one and two local experts; top-1 and top-2;
    # capacity ample and binding; dropless with uneven token counts, an expert no rank
    # routes to, a rank with no tokens; used_token; 2-d and 3-d inputs.
    failures = [f for rank in _results(world_size) for f in rank["failures"]]
    assert failures == []


@world_sizes(2, 4)
def test_binding_capacity_drops_what_the_counts_say(world_size):
    for rank in _results(world_size):
        total = 0
        for (ep, num_experts, k, case), fact in rank["facts"].items():
            if case != "binding" or k != 1:
                continue
            # top-1, a token dropped <=> its output row is 0: each expert keeps C of its tokens
            cap = capacity(fact["tokens"], num_experts, 0.5, 1)
            assert sum(fact["exp_counts"]) == fact["tokens"]
            assert fact["dropped"] == sum(max(0, c - cap) for c in fact["exp_counts"])
            total += fact["dropped"]
        assert total > 0  # the capacity did bind somewhere


@world_sizes(2, 4)
def test_dropless_reaches_every_expert_and_drops_nothing(world_size):
    for rank in _results(world_size):
        for (ep, num_experts, k, case), fact in rank["facts"].items():
            if case.startswith("dropless") and "used_token" not in case:
                assert fact["dropped"] == 0, case
                assert sum(fact["exp_counts"]) == k * fact["tokens"], case
            if case == "dropless dead expert":
                assert fact["exp_counts"][0] == 0


def _all_reduce_of_the_capacity(n: int) -> dict:
    return {"calls": 1, "bytes": ring_bytes("all_reduce", 8, n)}  # one int64, MAX


@world_sizes(2, 4)
def test_capacity_mode_moves_tokens_x_hidden_x_k_x_capacity_factor(world_size):
    # Per MoE layer and rank: 2 all-to-alls forward (dispatch, combine) and 2 backward, each
    # of the E x C x M buffer, S x k x capacity factor x M elements; (n-1)/n leaves the rank.
    # The only other collective is the capacity's all-reduce (8 bytes, forward).
    n = world_size
    num_tokens = 2 * 2 * n  # S = 2E
    for k in (1, 2):
        formula = int(num_tokens * k * CF) * M * 4 * (n - 1) // n  # float32
        assert formula == 2 * n * capacity(num_tokens, 2 * n, CF, 1, k=k) * M * 4 * (n - 1) // n
        for rank in _results(n):
            got = rank["bytes"]["capacity", k]
            for phase in ("forward", "backward"):
                assert got[phase]["all_to_all"] == {"calls": 2, "bytes": 2 * formula}, (k, phase)
            assert got["forward"]["all_reduce"] == _all_reduce_of_the_capacity(n)
            others = [s["bytes"] for phase in ("forward", "backward") for op, s in got[phase].items()
                      if op not in ("all_to_all", "all_reduce")]
            assert sum(others) + got["backward"]["all_reduce"]["calls"] == 0


@world_sizes(2, 4)
def test_capacity_mode_with_different_token_counts_pads_to_the_largest_capacity(world_size):
    # Rank r holds S_r = 2E + 4r tokens: C_r differs by rank and every rank exchanges the
    # largest (the last rank's), so the buffers agree; the parity cases "binding uneven" and
    # "capacity empty rank" show that the routing is still each rank's own.
    n = world_size
    num_experts = 2 * n
    for k in (1, 2):
        largest = capacity(2 * num_experts + 4 * (n - 1), num_experts, CF, 1, k=k)
        assert capacity(2 * num_experts, num_experts, CF, 1, k=k) < largest
        per_call = num_experts * largest * M * 4 * (n - 1) // n
        for rank in _results(n):
            got = rank["bytes"]["capacity uneven", k]
            for phase in ("forward", "backward"):
                assert got[phase]["all_to_all"] == {"calls": 2, "bytes": 2 * per_call}, (k, phase)
            assert got["forward"]["all_reduce"] == _all_reduce_of_the_capacity(n)


@world_sizes(2, 4)
def test_dropless_moves_exactly_the_routed_tokens(world_size):
    n = world_size
    num_experts, local = 2 * n, 2
    for k in (1, 2):
        results = [rank["bytes"]["dropless", k] for rank in _results(n)]
        counts = [r["counts"] for r in results]  # [rank][expert]: choices routed, none dropped
        for r, got in enumerate(results):
            assert sum(counts[r]) == k * got["tokens"]
            mine = range(r * local, (r + 1) * local)
            sent_away = sum(c for e, c in enumerate(counts[r]) if e not in mine)
            received = sum(counts[j][e] for j in range(n) if j != r for e in mine)
            tokens = (sent_away + received) * M * 4  # out and back, float32
            count_bytes = num_experts * 8 * (n - 1) // n  # the int64 counts exchange
            assert got["forward"]["all_to_all"] == {"calls": 3, "bytes": count_bytes + tokens}
            assert got["backward"]["all_to_all"] == {"calls": 2, "bytes": tokens}
            for phase in ("forward", "backward"):
                assert sum(s["bytes"] for op, s in got[phase].items() if op != "all_to_all") == 0


@world_sizes(2, 4)
def test_experts_without_tokens_on_some_or_all_ranks(world_size):
    for rank, result in enumerate(_results(world_size)):
        for (ep, num_experts, k, case), fact in result["facts"].items():
            if case.endswith("dead expert"):
                assert fact["exp_counts"][0] == 0, case
            elif case.endswith("dead expert on rank 0"):
                assert (fact["exp_counts"][0] == 0) == (rank == 0), (rank, case, fact)
            elif case.endswith("no tokens"):
                assert fact["exp_counts"] == [0] * num_experts and fact["tokens"] == 0


def test_a_group_of_the_wrong_size_is_named():
    message = _results(2)[0]["errors"]["group size"]
    assert "has 2 ranks but the layer was built with ep_size=4" in message


@pytest.fixture(autouse=True, scope="module")
def _forget_results():
    yield
    _results.cache_clear()
