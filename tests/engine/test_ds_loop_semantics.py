"""The training loop as DeepSpeed's callers see it (issue 35): what `engine.backward`
returns, the no_sync errors' types, and `ignore_unused_parameters: false`."""

import pytest
import torch
from torch import nn

from meshspeed.testing import run_distributed
from meshspeed.testing.engines import small_engine


def _backward_returns(gas, scale_wrt_gas, fp16):
    extra = {"fp16": {"enabled": True, "initial_scale_power": 8}} if fp16 else {}
    engine = small_engine(0, gradient_accumulation_steps=gas, **extra)
    x = torch.randint(0, 16, (1, 4))
    loss = engine(x, x)
    returned = engine.backward(loss, scale_wrt_gas=scale_wrt_gas)
    return loss.item(), returned.item(), engine.loss_scaler.scale


@pytest.mark.parametrize("gas, scale_wrt_gas, fp16, divisor",
                         [(4, True, False, 4), (4, False, False, 1), (2, True, True, 2), (1, True, False, 1)])
def test_backward_returns_the_loss_divided_by_the_accumulation_steps(gas, scale_wrt_gas, fp16, divisor):
    (loss, returned, scale), = run_distributed(_backward_returns, world_size=1, args=(gas, scale_wrt_gas, fp16))
    assert returned == pytest.approx(loss / divisor, rel=1e-6)  # never times the loss scale
    assert scale == (256.0 if fp16 else 1.0)


def _no_sync_misuse():
    from meshspeed.engine.errors import NoSyncError

    out = {}
    sharded = small_engine(2)
    try:
        with sharded.no_sync():
            pass
    except AssertionError as err:
        out["stage2"] = (type(err) is NoSyncError, str(err))
    engine = small_engine(1)
    with engine.no_sync():
        try:
            with engine.no_sync():
                pass
        except AssertionError as err:
            out["nested"] = str(err)
        x = torch.randint(0, 16, (1, 4))
        engine.backward(engine(x, x))
        try:
            engine.step()
        except AssertionError as err:
            out["step"] = (isinstance(err, RuntimeError), str(err))
    return out


def test_no_sync_misuse_raises_assertion_errors_with_deepspeeds_phrases():
    (out,) = run_distributed(_no_sync_misuse, world_size=1)
    is_ours, msg = out["stage2"]
    assert is_ours and msg.startswith("no_sync context manager is incompatible with ZeRO stage 2")
    assert out["nested"].startswith("no_sync context manager reentry is unsupported")
    still_runtime, msg = out["step"]
    assert still_runtime and msg.startswith("It is illegal to call Engine.step() inside no_sync context manager")


class _WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.used = nn.Linear(4, 4)
        self.unused = nn.Linear(4, 4)

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.used(x), y)


def _unused(zero, ignore, steps):
    """`steps` micro-steps at gas 2; returns the step() call that raised and the error."""
    import meshspeed

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = _WithUnused()
    zero = {**zero, **({} if ignore is None else {"ignore_unused_parameters": ignore})}
    engine, *_ = meshspeed.initialize(model=model, model_parameters=model.parameters(), config={
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "zero_optimization": zero})
    for n in range(steps):
        x, y = torch.randn(2, 4), torch.randint(0, 4, (2,))
        engine.backward(engine(x, y))
        try:
            engine.step()
        except AssertionError as err:
            return n, type(err).__name__, str(err)
    return None


ZERO = [{"stage": 0}, {"stage": 1}, {"stage": 2}, {"stage": 3},
        {"stage": 2, "offload_optimizer": {"device": "cpu"}}]


@pytest.mark.parametrize("zero", ZERO, ids=["0", "1", "2", "3", "2-offload"])
def test_unused_parameter_refused_at_the_boundary_step_on_every_rank(zero):
    for raised in run_distributed(_unused, world_size=2, args=(zero, False, 4), timeout=90):
        assert raised is not None, "a parameter without gradient was stepped over"
        at, kind, msg = raised
        assert (at, kind) == (1, "UnusedParametersError")  # the first boundary (gas 2)
        assert "ignore_unused_parameters" in msg and "(unused.bias, unused.weight)" in msg


def test_unused_parameter_ignored_by_default():
    assert run_distributed(_unused, world_size=1, args=({"stage": 2}, None, 4)) == [None]
