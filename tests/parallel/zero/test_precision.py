"""bf16 and fp16 training across stages.

bf16 tracks the fp32 one-process reference loss within 0.02 nats per step over 10 steps
(bf16 keeps 8 bits of mantissa: activations and parameters round at ~4e-3 relative, and
the fp32 master weights keep the drift from compounding). fp16 forces an overflow with a
huge initial loss scale and checks that the step is skipped on every rank, the scale is
halved and training then proceeds.
"""

import pytest
import torch

import meshspeed
from meshspeed.models.gpt import GPT, GPTConfig
from meshspeed.testing import run_distributed
from meshspeed.testing.parity import ParitySetup, engine_runs, reference_run


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_tracks_fp32_reference(stage):
    setups = [ParitySetup(stage=stage, world=2, precision="bf16", tie=True, gas=2)]
    (losses, _), = run_distributed(engine_runs, world_size=2, args=(setups,))[0]
    ref_losses, _ = reference_run(setups[0])
    diffs = [abs(a - b) for a, b in zip(losses, ref_losses)]
    assert max(diffs) < 0.02, diffs


def _fp16_overflow(stage):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, max_seq_len=16, n_layer=2, n_head=2, d_model=32))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "fp16": {"enabled": True, "initial_scale_power": 20, "hysteresis": 1, "loss_scale_window": 1000},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = meshspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))
    from meshspeed.testing.parity import full_state_dict

    before = full_state_dict(engine)
    scales, skipped, states = [], [], []
    for _ in range(10):
        loss = engine(tokens[:, :-1], tokens[:, 1:])
        engine.backward(loss)
        engine.step()
        scales.append(engine.loss_scale)
        skipped.append(engine.skipped_steps)
        states.append(full_state_dict(engine))
    return scales, skipped, engine.global_steps, before, states


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_fp16_overflow_skips_step_and_halves_scale(stage):
    results = run_distributed(_fp16_overflow, world_size=2, args=(stage,))
    scales, skipped, steps, before, states = results[0]
    # 2^20 * loss overflows fp16 gradients: the step is skipped and, with hysteresis 1,
    # the scale halves at once; the parameters are exactly what they were
    assert scales[0] == 2.0**19 and skipped[0] == 1
    for name in before:
        torch.testing.assert_close(states[0][name], before[name], rtol=0, atol=0)
    assert steps == 10
    assert all(r[0] == scales and r[1] == skipped for r in results)  # every rank agrees
    # once the scale fits, steps are taken and the parameters move
    taken = [i for i in range(1, 10) if skipped[i] == skipped[i - 1]]
    assert taken, f"no step was taken after the overflow (scales {scales})"
    for i in taken:
        assert any(not torch.equal(states[i][n], states[i - 1][n]) for n in before)
