"""OneCycle and LRRangeTest (meshspeed/optim/cyclic_schedules.py): values against the
formulas worked by hand, through the config's `scheduler` section and the engine, and
resumed from a state dict or a checkpoint."""

import json
import logging

import pytest
import torch

import meshspeed
from meshspeed.config import load_config
from meshspeed.optim.cyclic_schedules import LRRangeTest, OneCycle
from meshspeed.optim.schedule_base import LRScheduleError
from meshspeed.optim.schedulers import build_scheduler
from meshspeed.testing import run_distributed


def adam(*lrs: float) -> torch.optim.Optimizer:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr} for lr in lrs]
    return torch.optim.Adam(groups, betas=(0.9, 0.999))


# cycle: first 4 steps up, 2 down; then decay every 2 steps.
ONE_CYCLE = {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0, "cycle_first_step_size": 4,
             "cycle_second_step_size": 2, "decay_step_size": 2, "decay_lr_rate": 0.5,
             "cycle_min_mom": 0.85, "cycle_max_mom": 0.95, "decay_mom_rate": 0.02}
# (iteration, lr, first beta), worked by hand from the module docstring's formulas:
# i=0: b=1, s=1/4; i=3: b=4, s=1 (peak); i=4: b=5, s=(6-5)/2; i=5: b=6=T, s=0;
# i=6: d=1, d/D=0.5: lr 0.1/1.25, mom 0.95*1.01; i=7: d/D=1: lr 0.1/1.5, mom 0.95*1.02.
ONE_CYCLE_BY_HAND = [(0, 0.325, 0.925), (1, 0.55, 0.90), (2, 0.775, 0.875), (3, 1.0, 0.85),
                     (4, 0.55, 0.90), (5, 0.1, 0.95), (6, 0.08, 0.9595),
                     (7, 0.1 / 1.5, 0.969)]


def test_one_cycle_lr_and_momentum_by_hand():
    opt = adam(0.5)
    sched = OneCycle(opt, **ONE_CYCLE)
    group = opt.param_groups[0]
    assert group["lr"] == pytest.approx(0.1)
    assert group["betas"] == pytest.approx((0.85, 0.999))  # Note [OneCycle's first momentum]
    assert sched.get_mom() == [pytest.approx((0.95, 0.999))]
    for iteration, lr, mom in ONE_CYCLE_BY_HAND:
        sched.step()
        assert sched.last_batch_iteration == iteration
        assert group["lr"] == pytest.approx(lr), iteration
        assert sched.get_lr() == [pytest.approx(lr)]
        # the second beta is the optimizer's own (Note [OneCycle's second beta])
        assert group["betas"] == pytest.approx((mom, 0.999)), iteration
        assert sched.get_mom() == [pytest.approx((mom, 0.999))]


def test_one_cycle_stairs_and_per_group_bounds():
    opt = adam(0.5, 0.5)
    sched = OneCycle(opt, cycle_min_lr=[0.1, 0.2], cycle_max_lr=[1.0, 0.6],
                     cycle_first_step_size=4, cycle_first_stair_count=2, cycle_momentum=False)
    got = []
    for _ in range(8):
        sched.step()
        got.append([g["lr"] for g in opt.param_groups])
    # b = 1..8; up: s = floor(2p/4)/2 -> 0, .5, .5, 1; down (stairs as the first half):
    # p = 5, 6, 7 -> floor(2(8-p)/4)/2 = .5, .5, 0; then b = 8 = T -> 0.
    scales = [0, 0.5, 0.5, 1, 0.5, 0.5, 0, 0]
    assert got == [pytest.approx([0.1 + 0.9 * s, 0.2 + 0.4 * s]) for s in scales]
    assert opt.param_groups[0]["betas"] == (0.9, 0.999)  # momentum left alone
    assert sched.get_mom() is None


def test_one_cycle_without_betas_warns_and_keeps_momentum(caplog):
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1, momentum=0.5)
    with caplog.at_level(logging.WARNING, logger="meshspeed"):
        sched = OneCycle(sgd, cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=2)
    assert "no 'betas'" in caplog.text
    sched.step()
    assert sgd.param_groups[0]["lr"] == pytest.approx(0.055)
    assert sgd.param_groups[0]["momentum"] == 0.5


@pytest.mark.parametrize("staircase, expected", [
    # lr = 0.01 * (1 + 0.5 * k), k = (i + 1) / 4, floored for the staircase
    (False, [0.01125, 0.0125, 0.01375, 0.015, 0.01625, 0.0175, 0.01875, 0.02]),
    (True, [0.01, 0.01, 0.01, 0.015, 0.015, 0.015, 0.015, 0.02]),
])
def test_lr_range_test_by_hand(staircase, expected):
    opt = adam(0.5)
    sched = LRRangeTest(opt, lr_range_test_min_lr=0.01, lr_range_test_step_size=4,
                        lr_range_test_step_rate=0.5, lr_range_test_staircase=staircase)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01)
    got = []
    for _ in range(8):
        sched.step()
        got.append(opt.param_groups[0]["lr"])
    assert got == pytest.approx(expected)
    assert sched.get_last_lr() == [pytest.approx(expected[-1])]


@pytest.mark.parametrize("kind, params", [("OneCycle", ONE_CYCLE), (
    "LRRangeTest", {"lr_range_test_min_lr": 0.01, "lr_range_test_step_size": 3,
                    "lr_range_test_step_rate": 2.0, "lr_range_test_staircase": True})])
def test_state_dict_round_trip_gives_the_same_next_values(kind, params):
    first_opt = adam(0.5)
    first = build_scheduler(first_opt, kind, dict(params))
    for _ in range(5):
        first.step()
    state = json.loads(json.dumps(first.state_dict()))
    resumed_opt = adam(0.5)
    resumed = build_scheduler(resumed_opt, kind, dict(params))
    resumed.load_state_dict(state)
    assert resumed.last_batch_iteration == 4
    for _ in range(3):  # on into the decay phase for OneCycle
        first.step()
        resumed.step()
        assert resumed_opt.param_groups[0]["lr"] == first_opt.param_groups[0]["lr"]
        assert resumed_opt.param_groups[0]["betas"] == first_opt.param_groups[0]["betas"]
    # also DeepSpeed's state dict, which has only the iteration
    resumed.load_state_dict({"last_batch_iteration": 2})
    fresh = build_scheduler(adam(0.5), kind, {**params, "last_batch_iteration": 2})
    assert resumed.get_lr() == fresh.get_lr()


@pytest.mark.parametrize("kind, params, message", [
    ("OneCycle", {"cycle_min_lr": 0.1}, "requires 'cycle_max_lr'"),
    ("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 1, "cycle_first_step_size": 0},
     "cycle_first_step_size must be greater than 0"),
    ("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 1, "cycle_second_step_size": -1},
     "cycle_second_step_size must be at least 0"),
    ("OneCycle", {"cycle_min_lr": [0.1, 0.2], "cycle_max_lr": 1},
     "cycle_min_lr has 2 values but the optimizer has 1 param groups"),
    ("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 1, "cycle_max_mom": "high"},
     "cycle_max_mom must be a number"),
    ("LRRangeTest", {"lr_range_test_step_size": 0},
     "lr_range_test_step_size must be a positive integer"),
    ("LRRangeTest", {"lr_range_test_staircase": "yes"},
     "lr_range_test_staircase must be true or false"),
    ("LRRangeTest", {"lr_range_test_min_lr": 1e-3, "lr_range_test_step": 10},
     "did you mean 'lr_range_test_step_size'"),
])
def test_bad_parameters_are_named(kind, params, message):
    with pytest.raises(LRScheduleError, match=message):
        build_scheduler(adam(0.5), kind, params)
    assert issubclass(LRScheduleError, ValueError)


def test_config_accepts_both_types():
    params = {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0}
    cfg = load_config({"scheduler": {"type": "OneCycle", "params": params}})
    assert cfg.scheduler.type == "OneCycle"
    assert load_config({"scheduler": {"type": "lrrangetest"}}).scheduler.type == "LRRangeTest"


class Regression(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.linear(x), y)


def _engine(config):
    torch.manual_seed(0)
    model = Regression()
    engine, _, _, sched = meshspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=config)
    return engine, sched


def _train(engine, steps):
    seen = []
    for _ in range(steps):
        x = torch.randn(2, 4)
        engine.backward(engine(x, x.sum(1, keepdim=True)))
        engine.step()
        group = engine.optimizer.param_groups[0]
        seen.append((group["lr"], group["betas"][0]))
    return seen


def _through_the_engine(directory):
    torch.set_num_threads(1)
    config = {"train_micro_batch_size_per_gpu": 2,
              "optimizer": {"type": "Adam", "params": {"lr": 0.5, "betas": [0.9, 0.999]}},
              "scheduler": {"type": "OneCycle", "params": ONE_CYCLE}}
    engine, sched = _engine(config)
    kind = type(sched).__name__
    seen = _train(engine, 3)
    engine.save_checkpoint(directory)
    later = _train(engine, 4)
    resumed, resumed_sched = _engine(config)
    resumed.load_checkpoint(directory)
    return kind, seen, later, _train(resumed, 4), resumed_sched.last_batch_iteration


def test_config_built_one_cycle_steps_with_the_engine_and_resumes(tmp_path):
    kind, seen, later, resumed, iteration = run_distributed(
        _through_the_engine, 1, args=(str(tmp_path),))[0]
    assert kind == "OneCycle"
    assert seen == [pytest.approx((lr, mom)) for _, lr, mom in ONE_CYCLE_BY_HAND[:3]]
    assert later == [pytest.approx((lr, mom)) for _, lr, mom in ONE_CYCLE_BY_HAND[3:7]]
    assert resumed == later
    assert iteration == 6
