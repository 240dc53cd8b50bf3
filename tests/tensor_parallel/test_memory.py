"""Model-state bytes per rank under tensor parallelism, measured against the formula.

tp=2 x dp=2 (world 4), fp32 AdamW: the engine's memory_breakdown (the tensors the rank
really holds) equals `meshspeed.planner.estimate_memory(..., tp=2)`: per rank Psi_tp =
split/tp + replicated parameters (the norms), then ZeRO's sharding of Psi_tp over dp
(params 4, grads 4, Adam moments 8 bytes per element). Tolerance: ZeRO's per-parameter
padding (at most dp-1 elements per tensor) and Adam's step scalars.
"""

from __future__ import annotations

import pytest
import torch

from meshspeed.models.gpt import GPTConfig
from meshspeed.planner import estimate_memory
from meshspeed.testing import run_distributed
from meshspeed.testing.parity import ParitySetup, build_model

MODEL = {"vocab_size": 64, "n_layer": 2, "n_head": 4, "n_kv_head": 2, "d_model": 32, "ffn_hidden": 64}


def _breakdown(stage: int):
    import meshspeed

    setup = ParitySetup(world=4, tp=2, stage=stage, gas=2, model=MODEL, clip=0.0)
    engine, *_ = meshspeed.initialize(model=build_model(setup), config=setup.ds_config())
    tokens = torch.randint(0, 64, (2, 17))
    for _ in range(3):  # one step, then the first micro-step of the next window
        engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
        engine.step()
    return engine.memory_breakdown(), len(list(engine.module.parameters()))


@pytest.mark.timeout(600)
def test_model_states_per_rank_match_the_estimator_formula():
    cfg = GPTConfig(max_seq_len=16, **MODEL)
    results = run_distributed(_stages, 4, timeout=500)
    for rank_result in results:
        for stage, (mem, tensors) in zip((0, 1, 2, 3), rank_result):
            est = estimate_memory(cfg.num_params(), dp=2, stage=stage, param_bytes=4, grad_bytes=4,
                                  optimizer_bytes=8, tp=2, model_shape=cfg, micro_batch_size=2,
                                  seq_len=16)
            slack = tensors * (2 - 1) * 4 * 3 + tensors * 8
            for key, got_key in (("params", "params"), ("grads", "grads"),
                                 ("optimizer_states", "optimizer_state")):
                assert abs(mem[got_key] - est[key]) <= slack, (
                    f"stage {stage}: {got_key} = {mem[got_key]} bytes, formula {est[key]} "
                    f"(Psi per tp rank {est['num_params_per_tp_rank']}, slack {slack})")
            # and the formula itself: half the split parameters, all the norms
            split = cfg.num_params() - (2 * cfg.n_layer + 1) * cfg.d_model
            assert est["num_params_per_tp_rank"] == split // 2 + (2 * cfg.n_layer + 1) * cfg.d_model


def _stages():
    return [_breakdown(s) for s in (0, 1, 2, 3)]
