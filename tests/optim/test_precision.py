"""Unscaling, overflow detection and the skip decision shared by all ranks (the max
all-reduce emulated in one process by patching `meshspeed.comm.all_reduce`, which
precision.py calls as `comm.all_reduce`)."""

import pytest
import torch

from meshspeed import comm
from meshspeed.config.precision import FP16Config
from meshspeed.optim.loss_scaler import DynamicLossScaler, StaticLossScaler, has_inf_or_nan
from meshspeed.optim.precision import NoScaler, build_scaler, unscale_and_check

INF, NAN = float("inf"), float("nan")


class FakeAllReduce:
    """An all-reduce over this rank and `others` (their local values); records the calls."""

    def __init__(self, *others):
        self.others = others
        self.calls = []

    def __call__(self, tensor, group=None, op="sum", async_op=False):
        self.calls.append((tensor.clone(), group, op))
        assert op == "max", op
        for other in self.others:
            tensor.copy_(torch.maximum(tensor, torch.as_tensor(other, dtype=tensor.dtype)))


def no_collective(*args, **kwargs):
    raise AssertionError("replicated gradients need no collective")


def test_unscale_divides_by_the_scale(monkeypatch):
    monkeypatch.setattr(comm, "all_reduce", no_collective)
    gs = [torch.tensor([1024.0, -2048.0]), torch.full((2, 2), 512.0, dtype=torch.bfloat16)]
    assert unscale_and_check(gs, 1024.0, groups=()) is False
    assert torch.equal(gs[0], torch.tensor([1.0, -2.0]))
    assert gs[1].dtype == torch.bfloat16
    assert torch.equal(gs[1], torch.full((2, 2), 0.5, dtype=torch.bfloat16))


def test_scale_one_leaves_grads_untouched(monkeypatch):
    monkeypatch.setattr(comm, "all_reduce", no_collective)
    g = torch.tensor([3.0, 1e-30])
    before = g.clone()
    assert unscale_and_check([g], 1.0, groups=()) is False
    assert torch.equal(g, before)


@pytest.mark.parametrize("bad", [INF, -INF, NAN])
def test_replicated_overflow_is_detected_locally(bad, monkeypatch):
    monkeypatch.setattr(comm, "all_reduce", no_collective)
    gs = [torch.ones(3), torch.tensor([1.0, bad], dtype=torch.float16)]
    assert unscale_and_check(gs, 8.0, groups=()) is True
    assert torch.equal(gs[0], torch.full((3,), 0.125))  # still unscaled


def test_no_grads_is_no_overflow(monkeypatch):
    monkeypatch.setattr(comm, "all_reduce", no_collective)
    assert unscale_and_check([], 4.0, groups=()) is False
    fake = FakeAllReduce(0.0)
    monkeypatch.setattr(comm, "all_reduce", fake)
    assert unscale_and_check([], 4.0, groups=[None]) is False
    assert len(fake.calls) == 1  # an empty rank still takes part in the vote


def test_large_finite_fp16_grads_are_not_an_overflow():
    g = torch.full((8,), 65504.0, dtype=torch.float16)  # fp16 max: sums of these overflow
    assert not has_inf_or_nan([g])
    assert unscale_and_check([g], 1.0, groups=()) is False


@pytest.mark.parametrize("mine, theirs", [(False, False), (True, False), (False, True),
                                          (True, True)])
def test_overflow_on_one_rank_makes_both_skip(mine, theirs, monkeypatch):
    def rank_grads(bad):
        return [torch.tensor([2.0, INF if bad else 4.0]), torch.ones(2)]

    decisions = []
    for local, other in ((mine, theirs), (theirs, mine)):  # rank 0, then rank 1
        gs = rank_grads(local)
        fake = FakeAllReduce(float(has_inf_or_nan(rank_grads(other))))
        monkeypatch.setattr(comm, "all_reduce", fake)
        decisions.append(unscale_and_check(gs, 2.0, groups=["dp"]))
        (sent, group, op), = fake.calls
        assert (sent.item(), sent.shape, group, op) == (float(local), (), "dp", "max")
        assert gs[1].tolist() == [0.5, 0.5]
    assert decisions == [mine or theirs] * 2


def test_build_scaler_from_config():
    assert isinstance(build_scaler(FP16Config()), NoScaler)
    assert build_scaler(FP16Config()).scale == 1.0
    static = build_scaler(FP16Config(enabled=True, loss_scale=128.0))
    assert isinstance(static, StaticLossScaler) and static.scale == 128.0
    dynamic = build_scaler(FP16Config(enabled=True, initial_scale_power=5, hysteresis=1,
                                      loss_scale_window=2, min_loss_scale=4.0))
    assert isinstance(dynamic, DynamicLossScaler)
    assert dynamic.scale == 32.0
    for _ in range(5):
        dynamic.update(overflow=True)
    assert dynamic.scale == 4.0  # halved each time (hysteresis 1) down to the floor


def test_no_scaler_is_inert():
    s = NoScaler()
    s.update(True)
    assert s.scale == 1.0 and s.state_dict() == {}
    s.load_state_dict({})
