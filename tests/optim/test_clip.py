"""Global gradient norm and clipping, replicated and sharded (the all-reduce emulated in
one process by patching `meshspeed.comm.all_reduce`, which clip.py calls as
`comm.all_reduce`)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshspeed import comm
from meshspeed.optim.clip import clip_by_norm_, global_grad_norm
from meshspeed.parallel.zero.layout import ParamLayout


def grads(seed=0, shapes=((3, 4), (5,), (2, 2, 2), ())):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) * 3 for s in shapes]


def full_norm(gs):
    return torch.cat([g.float().reshape(-1) for g in gs]).norm()


class FakeAllReduce:
    """Emulates an all-reduce over this rank and `others` (their local contributions)."""

    def __init__(self, others):
        self.others = others
        self.calls = []

    def __call__(self, tensor, group=None, op="sum", async_op=False):
        self.calls.append({"shape": tuple(tensor.shape), "dtype": tensor.dtype,
                           "device": tensor.device, "group": group, "op": op})
        for other in self.others:
            if op == "sum":
                tensor.add_(other)
            elif op == "max":
                torch.maximum(tensor, torch.as_tensor(other, dtype=tensor.dtype), out=tensor)
            else:
                raise AssertionError(f"unexpected op {op}")


def shard(gs, world):
    """Each rank's disjoint slices of every gradient, cut as ZeRO cuts them (layout.py)."""
    per_rank = [[] for _ in range(world)]
    for g in gs:
        lay = ParamLayout("g", tuple(g.shape), world, 0)
        flat = g.reshape(-1)
        for r in range(world):
            start = min(r * lay.chunk, lay.numel)
            per_rank[r].append(flat[start:start + lay.valid(r)])
    return per_rank


# -- replicated --------------------------------------------------------------------------------
def test_norm_matches_torch(monkeypatch):
    monkeypatch.setattr(comm, "all_reduce", None)  # never called without sharding groups
    gs = grads()
    ref = torch.nn.utils.get_total_norm(gs)
    norm = global_grad_norm(gs)
    assert norm.shape == () and norm.dtype == torch.float32
    torch.testing.assert_close(norm, ref)
    torch.testing.assert_close(norm, full_norm(gs))
    assert norm.item() > 1.0


def test_norm_of_no_grads_is_zero():
    assert global_grad_norm([]).item() == 0.0


def test_norm_of_half_precision_grads_is_computed_in_fp32():
    # the norm (600) is an fp16 number, its square is not (max 65504)
    gs = [torch.full((4,), 300.0, dtype=torch.float16), torch.full((2,), -1.0, dtype=torch.float16)]
    norm = global_grad_norm(gs)
    assert norm.dtype == torch.float32
    assert norm.item() == pytest.approx(math.sqrt(4 * 300.0**2 + 2))
    gs = [torch.full((3,), 2.0, dtype=torch.bfloat16)]
    norm = global_grad_norm(gs)
    assert norm.dtype == torch.float32
    assert norm.item() == pytest.approx(math.sqrt(12))


@pytest.mark.parametrize("max_norm", [0.5, 3.0, 1e6])
def test_clip_matches_torch_clip_grad_norm(max_norm):
    ours = grads(seed=1)
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in ours]
    for p, g in zip(params, ours):
        p.grad = g.clone()
    ref_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    norm = global_grad_norm(ours)
    before = [g.clone() for g in ours]
    clip_by_norm_(ours, max_norm, norm)
    torch.testing.assert_close(norm, ref_norm)
    for g, p in zip(ours, params):
        torch.testing.assert_close(g, p.grad)
    if max_norm > norm.item():  # below the limit: untouched
        assert all(torch.equal(a, b) for a, b in zip(ours, before))
    else:
        assert global_grad_norm(ours).item() == pytest.approx(max_norm, rel=1e-5)


def test_clip_scales_in_place_and_keeps_dtype():
    gs = [torch.full((4,), 3.0, dtype=torch.bfloat16), torch.full((4,), 4.0, dtype=torch.bfloat16)]
    views = list(gs)
    clip_by_norm_(gs, 1.0, global_grad_norm(gs))  # norm 10: scale by ~0.1
    assert all(a is b for a, b in zip(gs, views))
    assert gs[0].dtype == torch.bfloat16
    torch.testing.assert_close(gs[0].float(), torch.full((4,), 0.3), rtol=1e-2, atol=0)
    torch.testing.assert_close(gs[1].float(), torch.full((4,), 0.4), rtol=1e-2, atol=0)


def test_clip_of_no_grads_is_a_no_op():
    clip_by_norm_([], 1.0, torch.tensor(5.0))


# -- sharded -----------------------------------------------------------------------------------
def local_sq(gs):
    return global_grad_norm(gs).square()


@settings(deadline=None, max_examples=30)
@given(world=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_sharded_norm_over_disjoint_slices_is_the_full_norm(world, seed):
    gs = grads(seed, shapes=((7, 3), (5,), (1,), (2, 3)))
    per_rank = shard(gs, world)
    ref = full_norm(gs)
    for r in range(world):
        others = [local_sq(per_rank[o]) for o in range(world) if o != r]
        fake = FakeAllReduce(others)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(comm, "all_reduce", fake)
            norm = global_grad_norm(per_rank[r], groups=["dp"])
        assert len(fake.calls) == 1
        assert fake.calls[0] == {"shape": (), "dtype": torch.float32,
                                 "device": torch.device("cpu"), "group": "dp", "op": "sum"}
        torch.testing.assert_close(norm, ref)


def test_sharded_norm_without_the_all_reduce_is_only_the_local_part(monkeypatch):
    gs = grads(2)
    mine, theirs = shard(gs, 2)
    monkeypatch.setattr(comm, "all_reduce", FakeAllReduce([]))
    local = global_grad_norm(mine, groups=[None])
    assert local.item() < full_norm(gs).item()
    monkeypatch.setattr(comm, "all_reduce", FakeAllReduce([local_sq(theirs)]))
    torch.testing.assert_close(global_grad_norm(mine, groups=[None]), full_norm(gs))


def test_sharded_rank_without_grads_still_joins_the_all_reduce(monkeypatch):
    gs = grads(3)
    fake = FakeAllReduce([local_sq(gs)])
    monkeypatch.setattr(comm, "all_reduce", fake)
    norm = global_grad_norm([], groups=[None], device=torch.device("cpu"))
    assert len(fake.calls) == 1
    torch.testing.assert_close(norm, full_norm(gs))


def test_sharded_clip_equals_clipping_the_full_gradients(monkeypatch):
    gs = grads(4)
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in gs]
    for p, g in zip(params, gs):
        p.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    per_rank = shard(gs, 2)
    contributions = [local_sq(per_rank[r]) for r in range(2)]  # before any rank clips
    for r in range(2):
        monkeypatch.setattr(comm, "all_reduce", FakeAllReduce([contributions[1 - r]]))
        clip_by_norm_(per_rank[r], 1.0, global_grad_norm(per_rank[r], groups=[None]))
    # the slices are views: the full gradients are now clipped as torch clips them
    for g, p in zip(gs, params):
        torch.testing.assert_close(g, p.grad)
