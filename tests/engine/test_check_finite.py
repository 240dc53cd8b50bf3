"""Opt-in `check_finite`: a step whose fp32/bf16 gradients are not finite is skipped on
every rank and reported, as fp16 overflow is (issue 9 case 8: NaN in one rank's batch
used to poison every parameter without a word)."""


import pytest
import torch

import meshspeed
from meshspeed.models.gpt import GPT, GPTConfig
from meshspeed.testing import run_distributed


def _nan_on_rank1(stage, check, precision):
    from meshspeed import comm

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=16, max_seq_len=4, n_layer=1, n_head=2, d_model=8))
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": stage}, "check_finite": check}
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    engine, *_ = meshspeed.initialize(model=model, config=config)
    x = torch.randint(0, 16, (1, 4))

    def step(poison: bool):
        loss = engine(x, x)
        if poison and comm.get_rank() == 1:
            loss = loss * float("nan")
        engine.backward(loss)
        engine.step()

    step(False)
    before = {k: v.clone() for k, v in engine.state_dict().items()}
    step(True)
    after = {k: v.clone() for k, v in engine.state_dict().items()}
    unchanged = all(torch.equal(before[k], after[k]) for k in before)
    finite = all(torch.isfinite(v).all() for v in after.values())
    step(False)
    moved = any(not torch.equal(after[k], v) for k, v in engine.state_dict().items())
    return unchanged, finite, engine.skipped_steps, engine.global_steps, moved


@pytest.mark.parametrize("stage, precision", [(0, "fp32"), (2, "fp32"), (3, "bf16")])
def test_non_finite_gradients_skip_the_step_everywhere(stage, precision):
    for unchanged, finite, skipped, steps, moved in run_distributed(
            _nan_on_rank1, world_size=2, args=(stage, True, precision)):
        assert unchanged and finite and skipped == 1 and steps == 3 and moved


def test_without_the_key_nan_still_spreads():
    for unchanged, finite, skipped, _, _ in run_distributed(_nan_on_rank1, world_size=2, args=(2, False, "fp32")):
        assert not finite and skipped == 0 and not unchanged
