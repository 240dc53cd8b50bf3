"""Exact resume (world size 2): N steps, save, M steps == fresh engine, load, M steps.

Losses and final parameters must be bitwise equal, for every ZeRO stage, with gradient
accumulation, and with fp16 dynamic loss scaling (including skipped steps) and bf16.
"""

from __future__ import annotations

import pytest

from meshspeed.testing.harness import run_distributed
from tests.checkpoint import workers

N, M = 2, 3
# fp16 runs on CPU. With a first scale of 2**20 this model overflows at once (a step is
# skipped and the scale halves) and then takes good steps, so the checkpoint holds a
# loss scaler mid-trajectory and the resumed steps mix skipped and taken ones.
FP16 = {"fp16": {"initial_scale_power": 20, "loss_scale_window": 2, "hysteresis": 1}}
CASES = (
    [(f"fp32-stage{s}-gas2", {"stage": s, "gas": 2}) for s in range(4)]
    + [(f"fp16-stage{s}", {"stage": s, "precision": "fp16", "extra_config": FP16}) for s in (0, 2, 3)]
    + [("bf16-stage1", {"stage": 1, "precision": "bf16"})]
    + [(f"sgd-stage{s}", {"stage": s, "optimizer": "SGD", "clip": 0.0}) for s in (0, 2)]
    + [(f"frozen-tied-stage{s}", {"stage": s, "frozen": True, "tie": True}) for s in (0, 3)]
)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    setups = [workers.setup_for(2, steps=N + M, **kw) for _, kw in CASES]
    root = tmp_path_factory.mktemp("resume")
    per_rank = run_distributed(workers.resume_exact, 2, args=(setups, str(root), N, M))
    return dict(zip([name for name, _ in CASES], per_rank[0]))


@pytest.mark.parametrize("name", [name for name, _ in CASES])
def test_resume_is_bitwise_exact(results, name):
    r = results[name]
    assert r["losses_equal"], f"losses differ after resume: {r['losses']}"
    assert r["params_equal"], "parameters differ after resume"
    saved, loaded = r["counters"]
    assert saved == loaded  # step counters, accumulation position, loss-scaler state
    assert r["final_counters"][0] == r["final_counters"][1]
    assert r["client"] == ("hi", [0, 1, 2])
    assert r["path"].endswith(f"global_step{N}")


def test_fp16_case_skips_and_takes_steps(results):
    saved, _ = results["fp16-stage2"]["counters"]
    final, _ = results["fp16-stage2"]["final_counters"]
    assert saved["skipped_steps"] > 0 and saved["scaler"]["scale"] < 2.0**20
    assert final["global_steps"] - final["skipped_steps"] > saved["global_steps"] - saved["skipped_steps"]


def test_gas_case_counts_micro_steps(results):
    saved, _ = results["fp32-stage0-gas2"]["counters"]
    assert saved["micro_steps"] == 2 * N and saved["global_samples"] == 2 * N * workers.GLOBAL_ROWS


def test_data_position_and_sampler_epoch():
    out = run_distributed(workers.sampler_epoch_round_trip, 2)
    assert out == [(3, 24, 2), (3, 24, 2)]
