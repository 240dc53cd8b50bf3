"""1-bit Adam (`"type": "OneBitAdam"`) through `meshspeed.initialize`, 2 and 4 gloo ranks.

* warm-up (steps <= freeze_step): the engine's fp32 gradient all-reduce and Adam, equal to
  one process on the concatenated batch (losses and parameters at 1e-5);
* after freeze_step: no gradient all-reduce; per step the bytes of the compressed momentum
  all-reduce (Note [compressed all-reduce bytes]), ~1/32 of the fp32 all-reduce; every rank
  holds the same parameters;
* refusals: ZeRO > 0, bf16, unknown params.
"""

import copy

import pytest
import torch

from meshspeed import comm
from meshspeed.comm.compressed import compressed_allreduce_bytes
from meshspeed.config import ConfigError
from meshspeed.optim.onebit import OneBitAdam
from meshspeed.testing import run_distributed
from meshspeed.testing.parity import (
    ParitySetup,
    assert_close_parity,
    build_model,
    counted_steps,
    engine_run,
    full_state_dict,
    make_batches,
    model_loss,
    reference_run,
)


def _setup(world: int, freeze_step: int, steps: int, **params) -> ParitySetup:
    # eps 1e-6: see ParitySetup.optimizer_block (sign noise of rounding-level gradients)
    block = {"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": freeze_step, "eps": 1e-6,
                                              "weight_decay": 0.1, **params}}
    return ParitySetup(world=world, steps=steps, clip=0.0, extra_config={"optimizer": block})


@pytest.mark.parametrize("world", [2, 4])
def test_warm_up_is_adam_over_the_fp32_all_reduce(world):
    setup = _setup(world, freeze_step=100, steps=6)
    got = run_distributed(engine_run, world, args=(setup,))
    assert_close_parity(reference_run(setup, OneBitAdam), got[0])


def _compressed_run(setup: ParitySetup):
    import meshspeed

    model = build_model(setup)
    engine, opt, *_ = meshspeed.initialize(model=model, config=copy.deepcopy(setup.ds_config()))
    per_step, losses = counted_steps(engine, setup)
    sizes = [p.numel() for p in model.parameters() if p.requires_grad]
    return per_step, losses, full_state_dict(engine), sizes, opt.steps_taken()


@pytest.mark.parametrize("world", [2, 4])
def test_after_freeze_step_the_momentum_moves_in_one_bit(world):
    freeze, steps = 3, 7
    results = run_distributed(_compressed_run, world, args=(_setup(world, freeze, steps),))
    per_step, losses, state0, sizes, taken = results[0]
    assert taken == steps
    fp32 = comm.ring_bytes("all_reduce", 4 * sum(sizes), world)
    onebit = compressed_allreduce_bytes(sizes, world)  # each tensor padded, 2 scales each
    # the engine's step agreement (a few counters, Note [agreement before each step]) is
    # the only all-reduce left after freeze_step
    agreement = per_step[-1]["all_reduce"]
    assert agreement < 200
    for step, moved in enumerate(per_step, start=1):
        if step <= freeze:  # warm-up: the gradient all-reduce, nothing compressed
            assert moved["all_reduce"] - agreement == fp32
            assert moved["all_to_all"] == moved["all_gather"] == 0
        else:  # compressed: no gradient all-reduce; signs + scales, both stages
            assert moved["all_reduce"] == agreement
            assert moved["all_to_all"] + moved["all_gather"] == onebit
            signs = onebit - 2 * 4 * len(sizes) * (world - 1)  # less the scales
            assert 1 / 32 <= signs / fp32 < 1 / 31  # 1 bit per element (+ padding) vs 32
    for _, other_losses, state, _, _ in results[1:]:  # the same parameters on every rank
        assert other_losses != losses or world == 1  # ranks saw different data ...
        for name, tensor in state.items():
            assert torch.equal(tensor, state0[name]), name  # ... and hold the same weights
    assert all(torch.isfinite(t).all() for t in state0.values())


def _build(config: dict) -> str | None:
    """The ConfigError initialize raises (caught here: a failing rank restarts the pool)."""
    import meshspeed

    try:
        meshspeed.initialize(model=build_model(ParitySetup(world=2)), config=config)
    except ConfigError as err:
        return str(err)
    return None


def _refusal(overrides: dict) -> str:
    setup = _setup(2, freeze_step=2, steps=1)
    messages = run_distributed(_build, 2, args=({**setup.ds_config(), **overrides},))
    assert messages[0] is not None, f"{overrides} was accepted"
    return messages[0]


def test_refuses_what_is_not_built():
    assert "OneBitAdam needs ZeRO stage 0 (got ZeRO stage 1)" in _refusal(
        {"zero_optimization": {"stage": 1}})
    assert "OneBitAdam runs in fp32 only" in _refusal({"bf16": {"enabled": True}})
    assert "gradient_compression with optimizer.type: OneBitAdam" in _refusal(
        {"gradient_compression": {"method": "int8"}})


def test_params_are_deepspeeds():
    from meshspeed.optim.builder import build_optimizer

    groups = [{"params": [torch.nn.Parameter(torch.zeros(3))]}]
    opt = build_optimizer("OneBitAdam", {"lr": 1e-3, "freeze_step": 10, "cuda_aware": False,
                                         "comm_backend_name": "nccl", "betas": [0.9, 0.99]}, groups)
    assert isinstance(opt, OneBitAdam) and opt.freeze_step == 10
    with pytest.raises(ValueError, match="did you mean 'freeze_step'"):
        build_optimizer("OneBitAdam", {"freeze_steps": 10}, groups)
    with pytest.raises(ValueError, match="comm_backend_name"):
        build_optimizer("OneBitAdam", {"comm_backend_name": "gloo-ish"}, groups)
    with pytest.raises(ValueError, match="freeze_step"):
        build_optimizer("OneBitAdam", {"freeze_step": -1}, groups)
    masked = [{"params": groups[0]["params"], "exp_avg_mask": torch.ones(3)}]
    with pytest.raises(ValueError, match="exp_avg_mask is not built yet"):
        build_optimizer("OneBitAdam", {}, masked)


def _resume(path: str, freeze_step: int, block: dict | None = None, split: int = 4, steps: int = 6,
            clip: float = 1.0):
    """`split` steps, save, the rest; a fresh engine loads the checkpoint and takes the same
    rest (`block`: another optimizer block than OneBitAdam's)."""
    import meshspeed

    setup = _setup(2, freeze_step=freeze_step, steps=steps)
    if block is not None:
        setup.extra_config = {"optimizer": block}
    setup.gas, setup.clip = 2, clip  # accumulation and (after freeze, over dp) clipping too
    rows = slice(comm.get_rank() * setup.micro, (comm.get_rank() + 1) * setup.micro)
    batches = make_batches(setup)

    def train(engine, part):
        losses = []
        for batch in part:
            for micro in batch:
                loss = model_loss(setup, engine, micro[rows])
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
        return losses

    def fresh():
        return meshspeed.initialize(model=build_model(setup), config=copy.deepcopy(setup.ds_config()))

    engine, opt, *_ = fresh()
    train(engine, batches[:split])
    engine.save_checkpoint(path, tag="t")
    straight = train(engine, batches[split:])
    engine, opt, *_ = fresh()
    engine.load_checkpoint(path, tag="t")
    taken = opt.steps_taken()
    return straight, train(engine, batches[split:]), taken, engine.strategy._leave_local()


def test_checkpoint_resume(tmp_path):
    # warm-up: moments and step counts come back, the run continues exactly
    straight, resumed, taken, local = run_distributed(_resume, 2, args=(str(tmp_path / "a"), 100))[0]
    assert resumed == straight and taken == 4 and not local
    # compressed: the step count keeps gradients local; the error buffers restart at zero
    # (not saved, as in DeepSpeed), so the continuation is close but not bit-equal
    straight, resumed, taken, local = run_distributed(_resume, 2, args=(str(tmp_path / "b"), 2))[0]
    assert taken == 4 and local
    assert all(abs(a - b) < 0.2 for a, b in zip(straight, resumed))


def _nan_on_one_rank(setup: ParitySetup):
    import meshspeed

    model = build_model(setup)
    engine, *_ = meshspeed.initialize(model=model, config=copy.deepcopy(setup.ds_config()))
    rows = slice(comm.get_rank() * setup.micro, (comm.get_rank() + 1) * setup.micro)
    for step, batch in enumerate(make_batches(setup), start=1):
        engine.backward(model_loss(setup, engine, batch[0][rows]))
        if step == 4 and comm.get_rank() == 1:  # after freeze_step: gradients are local
            next(model.parameters()).grad.view(-1)[0] = float("nan")
        engine.step()
    return engine.skipped_steps, full_state_dict(engine)


def test_local_gradients_agree_on_skipping_and_clipping():
    """After freeze_step each rank holds its own gradient: the non-finite check and the
    clipping norm are reduced over dp (Note [gradients left local]), so a NaN on one rank
    skips the step on both, and both clip alike."""
    setup = _setup(2, freeze_step=2, steps=6)
    setup.clip = 0.01  # always active
    setup.extra_config["check_finite"] = True
    (skipped0, state0), (skipped1, state1) = run_distributed(_nan_on_one_rank, 2, args=(setup,))
    assert skipped0 == skipped1 == 1
    for name, tensor in state0.items():
        assert torch.equal(tensor, state1[name]) and torch.isfinite(tensor).all(), name


def test_a_variance_frozen_too_early_is_warned_about(caplog):
    """Note [a variance frozen too early]: freeze_step 2 at betas[1] 0.999 freezes 0.2% of
    the running variance; 693 steps freeze half of it and stay quiet."""
    import logging

    from meshspeed.optim.onebit import OneBitAdam

    w = torch.nn.Parameter(torch.zeros(3))
    with caplog.at_level(logging.WARNING, logger="meshspeed"):
        OneBitAdam([w], freeze_step=693)
        assert not caplog.records
        OneBitAdam([w], freeze_step=2)
    (record,) = caplog.records
    assert "freeze_step 2" in record.getMessage() and "smallest safe freeze_step is 693" in record.getMessage()
