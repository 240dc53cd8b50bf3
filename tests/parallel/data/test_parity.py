"""Data parallelism (stage 0) against one process on the concatenated batch.

World sizes 2 and 4; fp32; AdamW with clipping, and plain SGD with momentum and no
clipping (Adam is nearly blind to gradient scale, so a sum where a mean belongs would
pass with Adam and fail with SGD); accumulation 1 and 2; 10 steps; losses every step and
final parameters within 1e-5 relative.
"""

import pytest

from meshspeed.testing.parity import ParitySetup, check_parity


@pytest.mark.parametrize("world", [2, 4])
def test_stage0_matches_single_process(world):
    setups = [
        ParitySetup(stage=0, world=world, gas=gas, optimizer=opt, clip=clip, steps=10)
        for gas in (1, 2)
        for opt, clip in (("AdamW", 1.0), ("SGD", 0.0))
    ]
    check_parity(setups)


def test_stage0_tied_and_frozen():
    check_parity([ParitySetup(stage=0, world=2, tie=True, frozen=True, gas=2)])
