import json
import logging
import random

import pytest
import torch

from meshspeed.optim.loss_scaler import DynamicLossScaler, StaticLossScaler, has_inf_or_nan


def run(scaler, pattern: str) -> list[float]:
    """Feed a pattern of steps ('x' overflow, '.' good); return the scale after each."""
    out = []
    for c in pattern:
        scaler.update(c == "x")
        out.append(scaler.scale)
    return out


def test_initial_scale():
    assert DynamicLossScaler(initial_scale_power=16).scale == 2.0**16
    assert StaticLossScaler(128.0).scale == 128.0


def test_overflow_halves_after_hysteresis_is_used_up():
    s = DynamicLossScaler(initial_scale_power=10, hysteresis=2)
    assert run(s, "xxx") == [1024.0, 512.0, 256.0]
    s = DynamicLossScaler(initial_scale_power=10, hysteresis=1)
    assert run(s, "xx") == [512.0, 256.0]


def test_window_doubling():
    s = DynamicLossScaler(initial_scale_power=4, loss_scale_window=3, hysteresis=1)
    # grows on the good step after `window` good steps, then every `window` steps
    assert run(s, ".......") == [16, 16, 16, 32, 32, 32, 64]
    # an overflow restarts the count
    assert run(s, "x....") == [32, 32, 32, 32, 64]


def test_hysteresis_refill():
    # consecutive_hysteresis=False: only growing the scale refills the budget, so two
    # overflows separated by good steps still lower the scale.
    s = DynamicLossScaler(initial_scale_power=4, loss_scale_window=100, hysteresis=2)
    assert run(s, "x.x") == [16, 16, 8]
    # consecutive_hysteresis=True: any good step refills it.
    s = DynamicLossScaler(
        initial_scale_power=4, loss_scale_window=100, hysteresis=2, consecutive_hysteresis=True
    )
    assert run(s, "x.x.x") == [16, 16, 16, 16, 16]
    assert run(s, ".xx") == [16, 16, 8]
    # growing refills the budget with consecutive_hysteresis=False
    s = DynamicLossScaler(initial_scale_power=4, loss_scale_window=2, hysteresis=2)
    assert run(s, "x...x") == [16, 16, 16, 32, 32]


def test_min_clamp_and_advice(caplog):
    s = DynamicLossScaler(initial_scale_power=2, hysteresis=1, min_loss_scale=2.0)
    with caplog.at_level(logging.WARNING, logger="meshspeed.optim.loss_scaler"):
        assert run(s, "xxxxx") == [2.0, 2.0, 2.0, 2.0, 2.0]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 3  # 1st, 2nd and 4th overflow at the floor
    text = warnings[0].getMessage()
    assert "min_loss_scale=2.0" in text and "bf16" in text and "learning rate" in text
    # halving never undershoots the floor
    s = DynamicLossScaler(initial_scale_power=2, hysteresis=1, min_loss_scale=3.0)
    assert run(s, "x") == [3.0]


def deepspeed_reference(pattern, init, window, hysteresis, consecutive, min_scale):
    """DeepSpeed's update rule, written in its own iteration-counter form."""
    scale, cur_hyst, last_overflow, out = init, hysteresis, -1, []
    for it, c in enumerate(pattern):
        if c == "x":
            if hysteresis == 1 or cur_hyst == 1:
                scale = max(scale / 2, min_scale)
            else:
                cur_hyst -= 1
            last_overflow = it
        else:
            if consecutive:
                cur_hyst = hysteresis
            stable = it - last_overflow - 1
            if stable > 0 and stable % window == 0:
                if not consecutive:
                    cur_hyst = hysteresis
                scale *= 2
        out.append(scale)
    return out


@pytest.mark.parametrize("consecutive", [False, True])
@pytest.mark.parametrize("hysteresis", [1, 2, 3])
def test_matches_deepspeed_rule_on_random_patterns(consecutive, hysteresis):
    rng = random.Random(hysteresis + 10 * consecutive)
    pattern = "".join(rng.choice("x......") for _ in range(400))
    s = DynamicLossScaler(
        initial_scale_power=8,
        loss_scale_window=4,
        hysteresis=hysteresis,
        consecutive_hysteresis=consecutive,
        min_loss_scale=1.0,
    )
    expected = deepspeed_reference(pattern, 256.0, 4, hysteresis, consecutive, 1.0)
    assert run(s, pattern) == expected


def test_state_round_trip():
    a = DynamicLossScaler(initial_scale_power=6, loss_scale_window=3, hysteresis=2)
    run(a, "x..x.")
    state = json.loads(json.dumps(a.state_dict()))
    b = DynamicLossScaler(initial_scale_power=6, loss_scale_window=3, hysteresis=2)
    b.load_state_dict(state)
    pattern = "..x...x..x......"
    assert run(b, pattern) == run(a, pattern)
    static = StaticLossScaler(8.0)
    other = StaticLossScaler(1.0)
    other.load_state_dict(json.loads(json.dumps(static.state_dict())))
    assert other.scale == 8.0


def test_bad_arguments():
    with pytest.raises(ValueError):
        DynamicLossScaler(hysteresis=0)
    with pytest.raises(ValueError):
        DynamicLossScaler(loss_scale_window=0)
    with pytest.raises(ValueError):
        StaticLossScaler(0.0)


def test_has_inf_or_nan():
    ok = [torch.ones(3), torch.zeros(2, 2, dtype=torch.float16), None, torch.empty(0)]
    assert not has_inf_or_nan(ok)
    assert not has_inf_or_nan([])
    assert not has_inf_or_nan([torch.full((4,), 3e38)])  # large but finite: no false alarm
    assert has_inf_or_nan(ok + [torch.tensor([1.0, float("inf")])])
    assert has_inf_or_nan([torch.tensor([float("nan")], dtype=torch.bfloat16)])
    assert has_inf_or_nan([torch.tensor([-float("inf")], dtype=torch.float16), torch.ones(2)])
