"""0/1 Adam (`"type": "ZeroOneAdam"`) through `meshspeed.initialize`, 2 gloo ranks.

* the schedule as pure data (Note [0/1 Adam's schedule]);
* with only full steps it is 1-bit Adam's warm-up: equal to one process on the
  concatenated batch (losses and parameters at 1e-5);
* per step, the bytes of what the schedule says: the fp32 gradient all-reduce on full
  steps, the 1-bit all-reduce (compressed gradients, or u at a sync), nothing on local steps;
  parameters equal on every rank after a sync.
"""

import copy

import pytest
import torch

from meshspeed import comm
from meshspeed.comm.compressed import compressed_allreduce_bytes
from meshspeed.optim.zero_one import ZeroOneAdam, zero_one_plan
from meshspeed.testing import run_distributed
from meshspeed.testing.parity import (
    ParitySetup,
    assert_close_parity,
    build_model,
    counted_steps,
    engine_run,
    full_state_dict,
    reference_run,
)

SCHEDULE = {"var_freeze_step": 6, "var_update_scaler": 2, "local_step_scaler": 2, "local_step_clipper": 4}


def test_plan():
    # full steps double their interval every 2; after step 6, syncs every 1, 2, then 4 steps
    assert zero_one_plan(16, 6, 2, 2, 4) == [
        "full", "full", "compressed", "full", "compressed", "full",
        "sync", "sync", "local", "sync", "local", "sync", "local", "local", "local", "sync"]


def _setup(steps: int, **params) -> ParitySetup:
    block = {"type": "ZeroOneAdam", "params": {"lr": 1e-3, "eps": 1e-6, "weight_decay": 0.1, **params}}
    return ParitySetup(world=2, steps=steps, clip=0.0, extra_config={"optimizer": block})


def test_full_steps_only_match_one_process():
    setup = _setup(6, var_freeze_step=100, var_update_scaler=100)
    assert_close_parity(reference_run(setup, ZeroOneAdam), run_distributed(engine_run, 2, args=(setup,))[0])


def _run(setup: ParitySetup):
    import meshspeed

    model = build_model(setup)
    engine, *_ = meshspeed.initialize(model=model, config=copy.deepcopy(setup.ds_config()))
    per_step, _ = counted_steps(engine, setup)
    sizes = [p.numel() for p in model.parameters() if p.requires_grad]
    return per_step, full_state_dict(engine), sizes


def test_bytes_follow_the_plan_and_syncs_make_ranks_equal():
    setup = _setup(16, **SCHEDULE)
    (per_step, state0, sizes), (_, state1, _) = run_distributed(_run, 2, args=(setup,))
    fp32 = comm.ring_bytes("all_reduce", 4 * sum(sizes), 2)
    onebit = compressed_allreduce_bytes(sizes, 2)
    agreement = per_step[-1]["all_reduce"]  # the engine's step agreement, every step
    assert agreement < 200
    for kind, moved in zip(zero_one_plan(16, **SCHEDULE), per_step):
        compressed = moved["all_to_all"] + moved["all_gather"]
        if kind == "full":
            assert moved["all_reduce"] == fp32 + agreement and compressed == 0
        else:
            assert moved["all_reduce"] == agreement
            assert compressed == (0 if kind == "local" else onebit), kind
    for name, tensor in state0.items():  # step 16 is a sync
        assert torch.equal(tensor, state1[name]), name
        assert torch.isfinite(tensor).all()


def test_params_are_deepspeeds():
    from meshspeed.optim.builder import build_optimizer

    groups = [{"params": [torch.nn.Parameter(torch.zeros(3))]}]
    opt = build_optimizer("ZeroOneAdam", {"lr": 1e-3, **SCHEDULE, "cuda_aware": False,
                                          "comm_backend_name": "nccl"}, groups)
    assert isinstance(opt, ZeroOneAdam) and opt.var_freeze_step == 6
    with pytest.raises(ValueError, match="did you mean 'var_freeze_step'"):
        build_optimizer("ZeroOneAdam", {"freeze_step": 10}, groups)


def test_checkpoint_resume(tmp_path):
    from tests.optim.test_onebit import _resume

    # all steps full (fp32 all-reduce): the resumed run continues exactly
    block = {"type": "ZeroOneAdam", "params": {"lr": 1e-3, "eps": 1e-6, "var_freeze_step": 100,
                                               "var_update_scaler": 100}}
    straight, resumed, taken, local = run_distributed(_resume, 2, args=(str(tmp_path / "a"), 0, block))[0]
    assert resumed == straight and taken == 4 and not local
    # saved after a local step, resumed over local steps: a checkpoint holds rank 0's
    # parameters, anchor, momentum and counters, so rank 0 continues exactly (without
    # clipping, whose norm is over both ranks' local gradients)
    block["params"].update(var_freeze_step=1, local_step_scaler=2, local_step_clipper=8)
    assert zero_one_plan(7, 1, 100, 2, 8) == ["full", "sync", "sync", "sync", "local", "local", "local"]
    straight, resumed, taken, local = run_distributed(
        _resume, 2, args=(str(tmp_path / "b"), 0, block), kwargs={"split": 5, "steps": 7, "clip": 0.0})[0]
    assert taken == 5 and local
    assert resumed == straight
