"""Unit lifecycle transitions are checked: a wrong one fails with the unit's name and what
was wrong, instead of being ignored (gathering twice, releasing a sharded unit or one whose
module is running, a second reduce-scatter in one backward). World 2, gloo."""

import pytest
import torch

from meshspeed.models.gpt import GPTConfig
from meshspeed.parallel.zero.lifecycle import LifecycleError, ParamState
from meshspeed.testing import run_distributed
from meshspeed.testing.engines import small_engine

CFG = GPTConfig(vocab_size=32, max_seq_len=8, n_layer=2, n_head=2, d_model=16)


def _engine(stage):
    return small_engine(stage, cfg=CFG)


def _error(fn) -> str:
    try:
        fn()
    except LifecycleError as err:
        return str(err)
    return "no error"


def _stage3_transitions():
    engine = _engine(3)
    unit = next(u for u in engine.strategy.units if u.shard_params)
    out = {"initial": unit.state.value, "release sharded": _error(unit.release)}
    unit.gather()
    out["gathered"] = unit.state.value
    out["gather whole"] = _error(unit.gather)
    out["prefetch whole"] = _error(unit.gather_async)
    unit.in_use += 1  # as the unit's forward pre-hook does
    out["release in use"] = _error(unit.release)
    unit.in_use -= 1
    unit.release()
    out["released"] = unit.state.value
    # a prefetched unit that is released before use lets its all-gather land first
    unit.gather_async()
    out["prefetching"] = unit.state.value
    unit.release()
    out["prefetch released"] = unit.state.value
    x = torch.randint(0, CFG.vocab_size, (1, 8))
    engine.backward(engine(x, x))  # a real step passes every check
    engine.step()
    return out


def test_stage3_transitions_are_checked():
    for out in run_distributed(_stage3_transitions, world_size=2):
        assert out["initial"] == out["released"] == out["prefetch released"] == ParamState.SHARDED.value
        assert out["gathered"] == ParamState.WHOLE.value
        assert out["prefetching"] == ParamState.GATHERING.value
        assert "released twice" in out["release sharded"]
        assert "gathered twice" in out["gather whole"]
        assert "prefetched while whole" in out["prefetch whole"]
        assert "released while its module's forward is running" in out["release in use"]


def _reduce_twice(stage):
    engine = _engine(stage)
    unit = engine.strategy.units[0]
    first = unit.launch_reduce_scatter()
    message = _error(unit.launch_reduce_scatter)
    first()  # settle the one in flight (every rank launched it)
    again = _error(lambda: unit.launch_reduce_scatter()())  # allowed once settled
    released = "n/a" if unit.shard_params else _error(unit.release)
    return message, again, released


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_second_reduce_scatter_in_one_backward_is_refused(stage):
    for message, again, released in run_distributed(_reduce_twice, world_size=2, args=(stage,)):
        assert "reduce-scatter launched twice in one backward" in message
        assert message.startswith("unit ")  # names the unit
        assert again == "no error"
        if stage < 3:
            assert "never released" in released
