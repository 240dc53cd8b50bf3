"""DeepSpeed configs as real scripts write them (issue 10): DeepSpeed-Chat sets
offload_param at every stage, and DeepSpeed ignores it below stage 3."""

import logging

import torch

from meshspeed.testing.engines import small_engine, train_step


def test_offload_param_below_stage_3_warns_once_and_trains(caplog):
    with caplog.at_level(logging.WARNING, logger="meshspeed"):
        engine = small_engine(2, zero_optimization={
            "stage": 2, "offload_param": {"device": "cpu", "pin_memory": True}})
    lines = [r.getMessage() for r in caplog.records if "offload_param" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "zero_optimization.offload_param" in lines[0] and "no effect at ZeRO stage 2" in lines[0]
    x = torch.randint(0, 16, (1, 4))
    first = train_step(engine, x).item()
    for _ in range(5):
        last = train_step(engine, x).item()
    assert last < first
    assert engine.memory_breakdown()["tiers"]["host"] == 0  # nothing was offloaded


def _rng_after_load(tmp, keep_current):
    engine = small_engine(0, checkpoint={"load_rng_state": not keep_current})
    x = torch.randint(0, 16, (1, 4))
    train_step(engine, x)
    engine.save_checkpoint(tmp, tag="t")
    saved = torch.rand(3)  # what the next draw was at save time
    torch.manual_seed(1234)
    here = torch.rand(3)  # what the next draw is before loading
    torch.manual_seed(1234)
    engine.load_checkpoint(tmp, tag="t")
    return torch.rand(3), saved, here


def test_load_checkpoint_restores_rng_unless_told_to_keep_it(tmp_path):
    after, saved, _ = _rng_after_load(str(tmp_path / "a"), keep_current=False)
    torch.testing.assert_close(after, saved, rtol=0, atol=0)  # meshspeed's default
    after, _, here = _rng_after_load(str(tmp_path / "b"), keep_current=True)
    torch.testing.assert_close(after, here, rtol=0, atol=0)  # DeepSpeed's behaviour
