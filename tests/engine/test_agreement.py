"""Ranks agree on the step before taking it (Note [agreement before each step]): a rank
whose counters differ makes every rank raise meshspeed.DivergenceError naming it."""

import pytest
import torch

import meshspeed
from meshspeed.testing import run_distributed
from meshspeed.testing.engines import small_engine, train_step


def _next_step(engine, x):
    """(the DivergenceError message or None, global_steps) of one more micro-step."""
    try:
        engine.backward(engine(x, x))
        engine.step()
    except meshspeed.DivergenceError as err:
        return str(err), engine.global_steps
    return None, engine.global_steps


def _diverged(stage):
    from meshspeed import comm

    engine = small_engine(stage)
    x = torch.randint(0, 16, (1, 4))
    train_step(engine, x)  # agreed
    if comm.get_rank() == 1:
        engine.global_steps += 1  # as if this rank had taken a step the others did not
    return _next_step(engine, x)


@pytest.mark.parametrize("stage", [0, 3])
def test_disagreeing_counters_stop_every_rank(stage):
    results = run_distributed(_diverged, world_size=3, args=(stage,))
    for rank, (msg, steps) in enumerate(results):
        assert msg is not None, f"rank {rank} went on"
        assert steps == (2 if rank == 1 else 1)  # nobody stepped past the disagreement
        # stage 3 agrees before each forward too (Note [agreement before a micro-step's forward])
        assert msg.startswith("ranks disagree before the forward of micro-step 1" if stage == 3
                              else "ranks disagree before optimizer step")
        lines = [line.strip() for line in msg.splitlines()]
        micro = 1 if stage == 3 else 2  # stage 3 stops before the micro-step's forward
        assert f"rank 1: global_step 2, micro_step {micro}, skipped_steps 0   <-- differs" in lines
        assert f"rank 0: global_step 1, micro_step {micro}, skipped_steps 0" in lines


def _other_code_path(stage):
    from meshspeed import comm

    engine = small_engine(stage)
    x = torch.randint(0, 16, (1, 4))
    train_step(engine, x)
    # same bytes, so gloo pairs them and returns garbage: only the digest can tell
    if comm.get_rank() == 1:
        comm.all_reduce(torch.ones(4, dtype=torch.int32))
    else:
        comm.all_reduce(torch.ones(4, dtype=torch.float32))
    return _next_step(engine, x)


@pytest.mark.parametrize("stage", [0, 2])
def test_a_different_collective_sequence_stops_every_rank(stage):
    results = run_distributed(_other_code_path, world_size=2, args=(stage,))
    for rank, (msg, steps) in enumerate(results):
        assert msg is not None, f"rank {rank} went on after a different collective"
        assert steps == 1
        assert msg.startswith("ranks issued different collectives since the previous step"), msg
        lines = [line.strip() for line in msg.splitlines()]
        assert any(line.startswith("rank 1: #") and "all_reduce of 4 int32 at " in line and
                   "test_agreement.py:" in line for line in lines), msg
        assert any(line.startswith("rank 0: #") and "all_reduce of 4 float32" in line for line in lines), msg

