"""Tensor parallelism through meshspeed.initialize against a one-process reference.

Same seed, same data, fp32: the loss of every step and the final whole parameters (the
tp pieces gathered back into logical tensors) within 1e-5 relative, for tp=2 and for
tp=2 x dp=2 with ZeRO stages 0-3, with and without sequence parallelism, AdamW with
clipping and SGD without, on the reference GPT, a transformers Llama and GPT-2.
"""

from __future__ import annotations

import pytest

from meshspeed.testing.parity import ParitySetup, check_parity

pytest.importorskip("transformers")

STEPS = 3
CLIP = 0.05  # below these models' gradient norms, so clipping acts at every step; with SGD
#              (scale-sensitive, unlike Adam) a norm that counted the replicated parameters
#              once per tp rank, or the split ones once, changes the update


def _setups(world, **kw):
    return ParitySetup(world=world, tp=2, steps=STEPS, **kw)


@pytest.mark.timeout(900)
def test_tp2_gpt_adamw_clip_and_sgd_with_and_without_sp():
    check_parity([_setups(2, sequence_parallel=sp, optimizer=opt, clip=clip, gas=gas, tie=tie)
                  for sp in (False, True)
                  for opt, clip, gas, tie in (("AdamW", CLIP, 1, False), ("SGD", 0.0, 2, True),
                                              ("SGD", CLIP, 1, False))])


@pytest.mark.timeout(900)
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_tp2_dp2_gpt_every_zero_stage(sp):
    check_parity([_setups(4, stage=s, sequence_parallel=sp, clip=CLIP,
                          model={"n_head": 4, "n_kv_head": 2} if s == 1 else {})
                  for s in (0, 1, 2, 3)])


@pytest.mark.timeout(900)
def test_tp2_dp2_sgd_stage2_and_overlap():
    check_parity([_setups(4, stage=2, optimizer="SGD", clip=0.0, sequence_parallel=True),
                  _setups(4, stage=3, optimizer="SGD", clip=CLIP, sequence_parallel=False),
                  _setups(4, stage=1, sequence_parallel=True, overlap=True)])


@pytest.mark.timeout(900)
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_transformers_models(family):
    model = {"n_head": 4, "n_kv_head": 2} if family == "llama" else {}
    check_parity([_setups(2, family=family, sequence_parallel=False, model=model)])
    check_parity([_setups(4, family=family, stage=3, sequence_parallel=True, model=model),
                  _setups(4, family=family, stage=2, sequence_parallel=False, model=model, tie=True)])


def _reference_norms(setup):
    import torch

    from meshspeed.testing.parity import build_model, make_batches, model_loss

    model = build_model(setup)
    opt = torch.optim.SGD(model.parameters(), lr=setup.lr)
    norms = []
    for batch in make_batches(setup):
        model_loss(setup, model, batch.reshape(-1, setup.seq + 1)).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), setup.clip)))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return norms


def _engine_norms(setups):
    import meshspeed
    from meshspeed.testing.parity import build_model, train_steps

    out = []
    for setup in setups:
        engine, *_ = meshspeed.initialize(model=build_model(setup), config=setup.ds_config())
        norms = []
        for step in range(setup.steps):
            train_steps(engine, setup, first=step, last=step + 1)
            norms.append(engine.get_global_grad_norm())
        out.append(norms)
    return out


@pytest.mark.timeout(600)
def test_clipping_norm_counts_each_element_once():
    """The global norm equals the one-process norm to fp32 rounding: replicated parameters
    (norm weights) counted once, not once per tp rank, and every tp piece counted."""
    import torch

    from meshspeed.testing import run_distributed

    setups = [_setups(4, stage=s, optimizer="SGD", clip=CLIP, sequence_parallel=sp)
              for s, sp in ((0, True), (3, False), (2, True))]
    got = run_distributed(_engine_norms, 4, args=(setups,), timeout=500)
    for setup, norms in zip(setups, got[0]):
        ref = _reference_norms(setup)
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref), rtol=2e-6, atol=0,
                                   msg=lambda m, s=setup: f"{s}: {m}")
    assert all(g == got[0] for g in got), "ranks disagree on the norm"
