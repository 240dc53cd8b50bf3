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
