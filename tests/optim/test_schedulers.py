import json
import math

import pytest
import torch

from meshspeed.optim.schedulers import (
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_scheduler,
    warmup_fraction,
)


def make_optimizer(*lrs: float) -> torch.optim.Optimizer:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr} for lr in lrs]
    return torch.optim.SGD(groups)


def flat(rows: list[list[float]]) -> list[float]:
    return [x for row in rows for x in row]


def lrs_over(sched, steps: int) -> list[list[float]]:
    """lr of each group at iterations 0 .. steps-1 (step() is called before reading)."""
    out = []
    for _ in range(steps):
        sched.step()
        out.append([g["lr"] for g in sched.optimizer.param_groups])
    return out


def test_warmup_fraction_by_hand():
    assert warmup_fraction(-1, 10, "log") == 0.0
    assert warmup_fraction(0, 10, "log") == 0.0
    assert warmup_fraction(4, 10, "log") == pytest.approx(math.log(5) / math.log(10))
    assert warmup_fraction(9, 10, "log") == pytest.approx(1.0)
    assert warmup_fraction(4, 10, "linear") == pytest.approx(0.4)
    assert warmup_fraction(9, 10, "linear") == pytest.approx(0.9)
    assert warmup_fraction(10, 10, "linear") == 1.0


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
def test_warmup_lr(warmup_type):
    opt = make_optimizer(0.5)
    sched = WarmupLR(
        opt, warmup_min_lr=0.01, warmup_max_lr=0.11, warmup_num_steps=4, warmup_type=warmup_type
    )
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01)  # set at construction
    got = [lr[0] for lr in lrs_over(sched, 6)]
    if warmup_type == "log":
        fracs = [0.0, math.log(2) / math.log(4), math.log(3) / math.log(4), 1.0, 1.0, 1.0]
    else:
        fracs = [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    assert got == pytest.approx([0.01 + 0.1 * f for f in fracs])
    assert sched.get_last_lr() == pytest.approx([got[-1]])
    assert sched.get_lr() == pytest.approx([got[-1]])


def test_warmup_lr_defaults_to_each_groups_lr_and_takes_lists():
    opt = make_optimizer(1.0, 2.0)
    sched = WarmupLR(opt, warmup_num_steps=2, warmup_type="linear")
    assert flat(lrs_over(sched, 3)) == pytest.approx([0.0, 0.0, 0.5, 1.0, 1.0, 2.0])
    opt = make_optimizer(1.0, 2.0)
    sched = WarmupLR(
        opt,
        warmup_min_lr=[0.1, 0.2],
        warmup_max_lr=[0.3, 0.4],
        warmup_num_steps=2,
        warmup_type="linear",
    )
    assert flat(lrs_over(sched, 3)) == pytest.approx([0.1, 0.2, 0.2, 0.3, 0.3, 0.4])
    with pytest.raises(ValueError, match="param groups"):
        WarmupLR(make_optimizer(1.0, 2.0), warmup_min_lr=[0.1])


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
def test_warmup_decay_lr(warmup_type):
    opt = make_optimizer(1.0)
    sched = WarmupDecayLR(
        opt,
        total_num_steps=10,
        warmup_min_lr=0.0,
        warmup_max_lr=1.0,
        warmup_num_steps=4,
        warmup_type=warmup_type,
    )
    got = [lr[0] for lr in lrs_over(sched, 12)]
    warm = [warmup_fraction(i, 4, warmup_type) for i in range(4)]
    decay = [(10 - i) / 6 for i in range(4, 11)] + [0.0]  # (T - i) / (T - W), floored at 0
    assert got == pytest.approx(warm + decay)
    assert got[4] == pytest.approx(1.0) and got[10] == 0.0


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
def test_warmup_cosine_lr(warmup_type):
    opt = make_optimizer(2.0, 0.2)
    sched = WarmupCosineLR(
        opt,
        total_num_steps=8,
        warmup_min_ratio=0.1,
        warmup_num_steps=3,
        cos_min_ratio=0.01,
        warmup_type=warmup_type,
    )
    got = lrs_over(sched, 10)
    expected_ratio = []
    for i in range(10):
        if i < 3:
            expected_ratio.append(0.1 + 0.9 * warmup_fraction(i, 3, warmup_type))
        else:
            p = min(1.0, (i - 3 + 1) / 5)
            expected_ratio.append(0.01 + 0.99 * (1 + math.cos(math.pi * p)) / 2)
    assert [g[0] for g in got] == pytest.approx([2.0 * r for r in expected_ratio])
    assert [g[1] for g in got] == pytest.approx([0.2 * r for r in expected_ratio])
    assert got[-1][0] == pytest.approx(2.0 * 0.01)  # floor reached and held


def test_warmup_steps_below_two_are_clamped_like_deepspeed():
    sched = WarmupLR(make_optimizer(1.0), warmup_num_steps=1, warmup_type="log")
    assert sched.warmup_num_steps == 2
    with pytest.raises(ValueError, match="warmup_num_steps"):
        WarmupLR(make_optimizer(1.0), warmup_num_steps=0)


def test_unknown_warmup_type_warns_and_uses_log_like_deepspeed_but_a_config_is_refused():
    with pytest.warns(UserWarning, match="warmup_type 'exp'"):
        sched = WarmupCosineLR(make_optimizer(1.0), total_num_steps=20, warmup_type="exp",
                               warmup_num_steps=10)
    ref = WarmupCosineLR(make_optimizer(1.0), total_num_steps=20, warmup_type="log",
                         warmup_num_steps=10)
    assert sched.warmup_type == "log"
    assert [sched.lr_ratio(i) for i in range(15)] == [ref.lr_ratio(i) for i in range(15)]
    with pytest.raises(ValueError, match="warmup_type must be one of"):
        build_scheduler(make_optimizer(1.0), "WarmupLR", {"warmup_type": "exp"})


def test_step_to_explicit_iteration():
    sched = WarmupLR(make_optimizer(1.0), warmup_num_steps=10, warmup_type="linear")
    sched.step(5)
    assert sched.last_batch_iteration == 5
    assert sched.get_last_lr() == pytest.approx([0.5])


@pytest.mark.parametrize(
    "cls,kwargs",
    [
        (WarmupLR, {"warmup_num_steps": 5}),
        (WarmupDecayLR, {"total_num_steps": 12, "warmup_num_steps": 5, "warmup_type": "linear"}),
        (WarmupCosineLR, {"total_num_steps": 12, "warmup_num_steps": 5, "warmup_min_ratio": 0.2}),
    ],
)
def test_state_dict_round_trip_resumes_identically(cls, kwargs):
    reference = cls(make_optimizer(0.3, 0.6), **kwargs)
    full = lrs_over(reference, 14)

    first = cls(make_optimizer(0.3, 0.6), **kwargs)
    lrs_over(first, 6)
    state = json.loads(json.dumps(first.state_dict()))  # plain JSON-able numbers

    # Resume on an optimizer whose lrs are the last scheduled ones (as after loading an
    # optimizer checkpoint); the saved base lrs win.
    opt = make_optimizer(*first.get_last_lr())
    resumed = cls(opt, **kwargs)
    resumed.load_state_dict(state)
    assert resumed.get_last_lr() == pytest.approx(full[5])
    assert flat(lrs_over(resumed, 8)) == pytest.approx(flat(full[6:]))


def test_rebuilt_after_optimizer_load_sees_original_lr():
    opt = make_optimizer(1.0)
    sched = WarmupCosineLR(opt, total_num_steps=10, warmup_num_steps=2)
    lrs_over(sched, 5)
    opt2 = make_optimizer(123.0)
    opt2.load_state_dict(opt.state_dict())  # carries the scheduled lr and initial_lr
    again = WarmupCosineLR(opt2, total_num_steps=10, warmup_num_steps=2, last_batch_iteration=4)
    assert again.base_lrs == [1.0]
    assert again.get_last_lr() == pytest.approx(sched.get_last_lr())


def test_tensor_lr_is_updated_in_place():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.Adam([p], lr=torch.tensor(0.01))
    lr_tensor = opt.param_groups[0]["lr"]
    sched = WarmupLR(opt, warmup_num_steps=2, warmup_type="linear")
    lrs_over(sched, 3)  # iterations 0, 1, 2: warmup done at 2
    assert opt.param_groups[0]["lr"] is lr_tensor
    assert lr_tensor.item() == pytest.approx(0.01)


def test_build_scheduler():
    opt = make_optimizer(1.0)
    sched = build_scheduler(opt, "WarmupDecayLR", {"total_num_steps": 100, "warmup_num_steps": 10})
    assert isinstance(sched, WarmupDecayLR)
    with pytest.raises(ValueError, match="did you mean 'WarmupCosineLR'"):
        build_scheduler(opt, "WarmupCosineLr", {"total_num_steps": 10})
    with pytest.raises(ValueError, match="did you mean 'warmup_num_steps'"):
        build_scheduler(opt, "WarmupLR", {"warmup_num_step": 10})
    with pytest.raises(ValueError, match="requires 'total_num_steps'"):
        build_scheduler(opt, "WarmupCosineLR", {})
