"""The gradient setters and the local setters of `deepspeed.utils` (safe_set_full_grad,
safe_set_local_grad, safe_set_local_fp32_param, safe_set_local_optimizer_state) at stages
0-3 on 2 gloo ranks: what they write is what the next step uses.

A zeroed gradient makes AdamW's first step leave the parameter exactly as it was (moments 0,
weight decay 0) while every other parameter moves; a gradient replaced by a constant c makes
the first exp_avg exactly (1 - beta1) * c. Local writes are checked by reading the whole
value back."""

import pytest
import torch

import meshspeed
from meshspeed.compat.deepspeed.utils import (
    safe_get_full_fp32_param,
    safe_get_full_optimizer_state,
    safe_get_local_fp32_param,
    safe_get_local_grad,
    safe_get_local_optimizer_state,
    safe_set_full_grad,
    safe_set_local_fp32_param,
    safe_set_local_grad,
    safe_set_local_optimizer_state,
)
from meshspeed.models.gpt import GPT, GPTConfig
from meshspeed.testing import run_distributed
from tests.compat.models import one_thread

CFG = GPTConfig(vocab_size=64, max_seq_len=16, n_layer=1, n_head=2, d_model=32)
ZEROED, CONSTANT = "layers.0.attn.wq.weight", "layers.0.attn.wk.weight"


@one_thread()
def _run(stage):
    torch.manual_seed(0)
    model = GPT(CFG)
    engine, *_ = meshspeed.initialize(model=model, model_parameters=model.parameters(), config={
        "train_micro_batch_size_per_gpu": 2, "steps_per_print": 10_000,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.999], "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}})
    params = dict(model.named_parameters())
    before = {n: safe_get_full_fp32_param(p) for n, p in params.items()}
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(meshspeed.comm.get_rank()))
    engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
    with pytest.raises(ValueError, match="the value has 3"):
        safe_set_local_grad(params[ZEROED], torch.zeros(3))
    safe_set_local_grad(params[ZEROED], torch.zeros_like(safe_get_local_grad(params[ZEROED])))
    safe_set_full_grad(params[CONSTANT], torch.full(params[CONSTANT].shape if stage < 3 else
                                                    params[CONSTANT].ds_shape, 0.5))
    engine.step()
    after = {n: safe_get_full_fp32_param(p) for n, p in params.items()}
    exp_avg = safe_get_full_optimizer_state(params[CONSTANT], "exp_avg")
    # local writes: this rank's range, read back whole
    local = safe_get_local_fp32_param(params[ZEROED])
    safe_set_local_fp32_param(params[ZEROED], torch.full_like(local, float(meshspeed.comm.get_rank() + 1)))
    state = safe_get_local_optimizer_state(params[ZEROED], "exp_avg_sq")
    safe_set_local_optimizer_state(params[ZEROED], torch.full_like(state, 7.0), "exp_avg_sq")
    return {"before": before, "after": after, "exp_avg": exp_avg, "local_numel": local.numel(),
            "written": safe_get_full_fp32_param(params[ZEROED]),
            "written_state": safe_get_full_optimizer_state(params[ZEROED], "exp_avg_sq")}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_setters_write_what_the_next_step_uses(stage):
    out = run_distributed(_run, 2, args=(stage,))
    r0 = out[0]
    assert torch.equal(r0["after"][ZEROED], r0["before"][ZEROED])  # zero gradient: no move
    moved = [n for n in r0["before"] if not torch.equal(r0["after"][n], r0["before"][n])]
    assert len(moved) == len(r0["before"]) - 1
    assert torch.allclose(r0["exp_avg"], torch.full_like(r0["exp_avg"], 0.05), rtol=0, atol=1e-7)
    # rank r wrote r + 1 into its range: the whole value is the ranks' ranges in order
    flat = r0["written"].reshape(-1)
    if stage == 0:  # every rank holds the whole parameter; both wrote, the value is rank 0's
        assert torch.equal(flat, torch.full_like(flat, 1.0))
    else:
        n0 = out[0]["local_numel"]
        assert torch.equal(flat[:n0], torch.full((n0,), 1.0)) and torch.equal(flat[n0:], torch.full_like(flat[n0:], 2.0))
    assert torch.equal(r0["written_state"], torch.full_like(r0["written_state"], 7.0))


def test_a_setter_on_a_model_no_engine_owns_says_so():
    torch.manual_seed(0)
    model = GPT(CFG)
    with pytest.raises(ValueError, match="belongs to no model"):
        safe_set_local_grad(next(model.parameters()), torch.zeros(1))
