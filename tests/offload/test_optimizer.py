"""OffloadOptimizer in one process against torch.optim, for each store."""

import pytest
import torch
from torch import nn

from meshspeed.config import ConfigError
from meshspeed.offload.aio import SwapEngine
from meshspeed.offload.kernels import AdamRule, SgdRule
from meshspeed.offload.optimizer import BackgroundStep, OffloadOptimizer
from meshspeed.offload.state import HostStore, SwapStore, split_sub_groups

SHAPES = [(300,), (7,), (1000,), (64,), (2500,), (1,)]


def _params():
    g = torch.Generator().manual_seed(0)
    return [nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def _grads(params, step):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g) for p in params]


def _offloaded(params, kind, store, tmp_path=None, *, fused=False, sub=800, buffers=4, runner=None):
    groups = [{"params": params[:3]}, {"params": params[3:], "weight_decay": 0.0}]
    if kind == "adamw":
        template = torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1, fused=fused)
        rule = AdamRule(decoupled=True, fused=fused)
    else:
        template = torch.optim.SGD(groups, lr=1e-2, momentum=0.9, dampening=0.1)
        rule = SgdRule(momentum=True, fused=fused)

    def make(sub_groups):
        if store == "host":
            return HostStore(rule, pin=False)
        return SwapStore(rule, sub_groups, str(tmp_path), SwapEngine(), buffer_count=buffers,
                         pin=False, preallocate=True)

    return OffloadOptimizer(template, rule, make, sub_group_size=sub, runner=runner)


def _reference(kind):
    params = _params()
    groups = [{"params": params[:3]}, {"params": params[3:], "weight_decay": 0.0}]
    if kind == "adamw":
        return params, torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1)
    return params, torch.optim.SGD(groups, lr=1e-2, momentum=0.9, dampening=0.1)


def _train(params, opt, steps=4, skip=None):
    for step in range(steps):
        for i, (p, g) in enumerate(zip(params, _grads(params, step))):
            p.grad = None if (skip is not None and i == skip and step == 0) else g
        opt.step()
        opt.wait() if hasattr(opt, "wait") else None
    return [p.detach().clone() for p in params]


def test_sub_groups_split_whole_parameters():
    params = _params()
    groups = split_sub_groups(params, 1000)
    assert [[p.numel() for p in g.params] for g in groups] == [[300, 7], [1000], [64], [2500], [1]]
    assert groups[0].offsets == [0, 300] and groups[0].numel == 307
    assert split_sub_groups(params, 10**9)[0].numel == sum(p.numel() for p in params)


@pytest.mark.parametrize("store, buffers", [("host", 4), ("nvme", 2), ("nvme", 4), ("nvme", 6)])
def test_adamw_exact(store, buffers, tmp_path):
    """Skipping a gradient on step 0 checks that unstepped parameters keep no state."""
    params, ref = _reference("adamw")
    want = _train(params, ref, skip=1)
    mine = _params()
    opt = _offloaded(mine, "adamw", store, tmp_path, buffers=buffers)
    got = _train(mine, opt, skip=1)
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    for p, q in zip(params, mine):  # state as torch keeps it
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(ref.state[p][key], opt.state[q][key]), key


def test_fused_within_a_few_ulp(tmp_path):
    params, ref = _reference("adamw")
    want = _train(params, ref)
    mine = _params()
    got = _train(mine, _offloaded(mine, "adamw", "nvme", tmp_path, fused=True))
    for a, b in zip(want, got):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("fused", [False, True])
def test_sgd_momentum_dampening(fused):
    params, ref = _reference("sgd")
    want = _train(params, ref)
    mine = _params()
    got = _train(mine, _offloaded(mine, "sgd", "host", fused=fused))
    for a, b in zip(want, got):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)


def test_state_dict_roundtrip_between_stores(tmp_path):
    a = _params()
    host = _offloaded(a, "adamw", "host")
    _train(a, host, steps=2)
    b = [nn.Parameter(p.detach().clone()) for p in a]
    swap = _offloaded(b, "adamw", "nvme", tmp_path)
    swap.load_state_dict(host.state_dict())
    assert torch.equal(swap.state[b[4]]["exp_avg"], host.state[a[4]]["exp_avg"])
    for pa, pb, g in zip(a, b, _grads(a, 9)):
        pa.grad, pb.grad = g, g.clone()
    host.step()
    swap.step()
    for pa, pb in zip(a, b):
        assert torch.equal(pa, pb)


def test_background_step_runs_off_thread_and_reports_errors(tmp_path):
    runner = BackgroundStep()
    mine = _params()
    opt = _offloaded(mine, "adamw", "nvme", tmp_path, runner=runner)
    params, ref = _reference("adamw")
    want = _train(params, ref)
    got = _train(mine, opt)  # _train waits after each step
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    runner.submit(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        runner.wait()
    runner.close()


def test_swap_store_needs_a_buffer_per_state(tmp_path):
    with pytest.raises(ConfigError, match="buffer_count"):
        _offloaded(_params(), "adamw", "nvme", tmp_path, buffers=1)


def test_read_ahead_is_dropped_when_its_file_changes_between_steps(tmp_path):
    """Note [the step's I/O outside the step]: after a step the store has read the first
    sub-groups' moments ahead; a write to one of those files before the next step (here
    straight through a swap engine) drops that read, and the next step still matches
    torch's AdamW given the same change."""
    params, ref = _reference("adamw")
    mine = _params()
    opt = _offloaded(mine, "adamw", "nvme", tmp_path, buffers=6)
    _train(params, ref, steps=2)
    _train(mine, opt, steps=2)
    store = opt.store
    store._join()
    assert sorted(store._early) == [0, 1, 2]  # 6 buffers, 2 per sub-group
    first = store.sub_groups[0]
    engine = SwapEngine()
    engine.write(torch.zeros(first.numel), store.path(first, "exp_avg")).wait()
    engine.close()
    for p in params[:2]:
        ref.state[p]["exp_avg"].zero_()
    for p, q, g in zip(params, mine, _grads(params, 7)):
        p.grad, q.grad = g, g.clone()
    ref.step()
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(params, mine))
    for p, q in zip(params, mine):
        assert torch.equal(ref.state[p]["exp_avg"], opt.state[q]["exp_avg"])


def test_memory_tensors_count_the_pool_while_it_reads_ahead(tmp_path):
    """Buffers the read-ahead holds between steps are still the pool's memory."""
    mine = _params()
    opt = _offloaded(mine, "adamw", "nvme", tmp_path, buffers=6)
    _train(mine, opt, steps=2)
    opt.store._join()
    assert opt.store._early  # some buffers are taken by the read-ahead now
    pool = 6 * opt.store.pool.nbytes
    held = {t.untyped_storage().data_ptr(): t.nbytes for t in opt.memory_tensors() if t.dim()}
    assert sum(held.values()) == pool
    assert sum(t.nbytes for t in opt.store.pool.tensors()) == pool
