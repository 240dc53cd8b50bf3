"""ZeRO stages 1-3 against one process on the concatenated batch (fp32).

Every stage at dp 2, 3 (uneven padding) and 4; accumulation 1 and 3; AdamW with clipping
and SGD with momentum and no clipping; the model has tied embeddings and a frozen
sub-module. Losses each step and final parameters within rtol 1e-5 (atol 1e-6 for
elements near zero).
"""

import pytest

from meshspeed.testing.parity import ParitySetup, check_parity


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_matches_single_process(stage, world):
    setups = [
        ParitySetup(stage=stage, world=world, gas=gas, optimizer=opt, clip=clip, steps=10,
                    tie=True, frozen=True)
        for gas in (1, 3)
        for opt, clip in (("AdamW", 1.0), ("SGD", 0.0))
    ]
    check_parity(setups)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_untied_unfrozen(stage):
    check_parity([ParitySetup(stage=stage, world=2, gas=2)])


def test_stage3_small_buckets_and_persistent_params():
    """Several units, some parameters kept whole below the persistence threshold, and a
    prefetch bucket too small to hold more than one unit."""
    extra = {"zero_optimization": {"stage3_param_persistence_threshold": 64,
                                   "stage3_prefetch_bucket_size": 1,
                                   "stage3_max_live_parameters": 1}}
    check_parity([ParitySetup(stage=3, world=2, gas=2, tie=True, extra_config=extra)])


def test_stage2_several_buckets():
    extra = {"zero_optimization": {"reduce_bucket_size": 2000}}
    check_parity([ParitySetup(stage=2, world=2, gas=2, extra_config=extra),
                  ParitySetup(stage=1, world=2, gas=2, extra_config=extra)])
