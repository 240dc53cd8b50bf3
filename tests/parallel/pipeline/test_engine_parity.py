"""Pipelined training equals one process (fp32, same seed and data, rtol 1e-5).

The model is the reference GPT's pipeline form (meshspeed.models.gpt_pipe.GPTPipe), the
reference the same form in one stage trained by plain PyTorch on the whole global batch
(meshspeed.testing.parity). Every step's loss and every final parameter are compared,
with gradient clipping on (the norm is summed over stages, tied copies counted once).
"""

import pytest

from meshspeed.testing.parity import ParitySetup, check_parity

BASE = {"steps": 3, "gas": 4, "micro": 2, "seq": 8, "model": {"n_layer": 4}}


def _setups(world, **changes):
    return ParitySetup(world=world, **{**BASE, **changes})


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_two_stages_equal_one_process(schedule):
    check_parity([_setups(2, pp=2, schedule=schedule), _setups(2, pp=2, schedule=schedule, tie=True)])


def test_four_stages_equal_one_process():
    check_parity([_setups(4, pp=4), _setups(4, pp=4, tie=True, schedule="gpipe")])


def test_pipeline_times_data_parallel_every_zero_stage():
    """pp=2 x dp=2: each stage's parameters sharded over its own data-parallel pair."""
    check_parity([_setups(4, pp=2, stage=s, tie=s in (0, 3)) for s in (0, 1, 2, 3)])


def test_pipeline_times_tensor_parallel():
    check_parity([_setups(4, pp=2, tp=2)])


def test_pipeline_tensor_data_parallel_on_eight_ranks():
    """pp x tp x dp = 2 x 2 x 2, with ZeRO-1 on each stage's data-parallel pair."""
    check_parity([_setups(8, pp=2, tp=2, stage=1, steps=2)])


@pytest.mark.parametrize("schedule,virtual", [("interleaved", 2), ("zb-h1", 1)])
def test_split_schedules_equal_one_process(schedule, virtual):
    """Chunks per stage (interleaved) and the split backward (ZB-H1) give the same losses
    and parameters as one process: at pp=2, and at pp=2 x dp=2 under ZeRO 1 and 3."""
    n_layer = 6 if schedule == "interleaved" else 4  # 8 layers in 4 runs of 2
    common = {"schedule": schedule, "virtual": virtual, "model": {"n_layer": n_layer}}
    check_parity([_setups(2, pp=2, **common), _setups(2, pp=2, tie=True, **common)])
    check_parity([_setups(4, pp=2, stage=s, **common) for s in (1, 3)])


def test_interleaved_from_the_config_alone():
    """DeepSpeed-style `PipelineModule(layers, num_stages=2)` and `"pipeline": {"schedule":
    "interleaved", "virtual_stages": 2}`: initialize cuts the stages again into chunks
    (Note [the mesh binds the stage]) and trains as one process does."""
    common = {"schedule": "interleaved", "virtual": 2, "virtual_in_config": True, "model": {"n_layer": 6}}
    check_parity([_setups(2, pp=2, **common)])
    check_parity([_setups(4, pp=2, stage=3, **common)])


def test_activation_checkpointing_in_stages_changes_nothing():
    """Every block recomputed in backward (meshspeed.checkpointing) under 1F1B and ZB-H1."""
    check_parity([_setups(2, pp=2, checkpoint_interval=1), _setups(2, pp=2, checkpoint_interval=1, schedule="zb-h1")])
