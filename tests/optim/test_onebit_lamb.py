"""1-bit LAMB (`"type": "OneBitLamb"`) through `meshspeed.initialize`, 2 gloo ranks.

* warm-up: LAMB over the fp32 all-reduce, equal to one process on the concatenated batch
  (losses and parameters at 1e-5);
* after freeze_step: no gradient all-reduce; the momenta move as ONE flat tensor with one
  scale (1 bit per element, Note [1-bit LAMB's two phases]); parameters equal on every rank.
"""

import copy

import pytest
import torch

from meshspeed import comm
from meshspeed.comm.compressed import compressed_allreduce_bytes
from meshspeed.optim.onebit_lamb import OneBitLamb
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


def _setup(freeze_step: int, steps: int) -> ParitySetup:
    block = {"type": "OneBitLamb", "params": {"lr": 1e-3, "freeze_step": freeze_step, "eps": 1e-6,
                                              "weight_decay": 0.1}}
    return ParitySetup(world=2, steps=steps, clip=0.0, extra_config={"optimizer": block})


def test_warm_up_is_lamb_over_the_fp32_all_reduce():
    setup = _setup(100, 6)
    assert_close_parity(reference_run(setup, OneBitLamb), run_distributed(engine_run, 2, args=(setup,))[0])


def _run(setup: ParitySetup):
    import meshspeed

    model = build_model(setup)
    engine, *_ = meshspeed.initialize(model=model, config=copy.deepcopy(setup.ds_config()))
    per_step, _ = counted_steps(engine, setup)
    return per_step, full_state_dict(engine), sum(p.numel() for p in model.parameters())


def test_after_freeze_step_one_flat_tensor_moves_in_one_bit():
    freeze, steps = 3, 7
    (per_step, state0, numel), (_, state1, _) = run_distributed(_run, 2, args=(_setup(freeze, steps),))
    fp32 = comm.ring_bytes("all_reduce", 4 * numel, 2)
    agreement = per_step[-1]["all_reduce"]  # the engine's step agreement
    for step, moved in enumerate(per_step, start=1):
        compressed = moved["all_to_all"] + moved["all_gather"]
        if step <= freeze:
            assert moved["all_reduce"] == fp32 + agreement and compressed == 0
        else:
            assert moved["all_reduce"] == agreement
            assert compressed == compressed_allreduce_bytes(numel, 2)  # one tensor, 2 scales
    for name, tensor in state0.items():
        assert torch.equal(tensor, state1[name]), name
        assert torch.isfinite(tensor).all()


def test_params_are_deepspeeds():
    from meshspeed.optim.builder import build_optimizer

    groups = [{"params": [torch.nn.Parameter(torch.zeros(3))]}]
    opt = build_optimizer("OneBitLamb", {"lr": 1e-3, "freeze_step": 10, "max_coeff": 5.0, "min_coeff": 0.1,
                                         "coeff_beta": 0.9, "factor_max": 4.0, "factor_min": 0.5,
                                         "factor_threshold": 0.1, "comm_backend_name": "mpi"}, groups)
    assert isinstance(opt, OneBitLamb) and opt.freeze_step == 10
    with pytest.raises(ValueError, match="did you mean 'max_coeff'"):
        build_optimizer("OneBitLamb", {"max_coef": 1.0}, groups)
