"""A rank that skips `engine.step()` and keeps training (issue 34, item 6): every rank
stops at once with a DivergenceError naming the rank and where each rank is, at every ZeRO
stage, with accumulation and with a pipeline, not after the comms timeout (Note [agreement
before a micro-step's forward], meshspeed/engine/agreement.py)."""

import pytest
import torch
from torch import nn

import meshspeed
from meshspeed.testing import run_distributed
from meshspeed.testing.engines import small_engine

TIMEOUT = 60  # the comms timeout is 300 s: a run that waits for it fails here


def _tokens(i: int) -> torch.Tensor:
    return torch.randint(0, 16, (1, 4), generator=torch.Generator().manual_seed(i))


def _skip_one_step(stage, gas, skip_at):
    """Rank 1 leaves out the step() of micro-step `skip_at`; both go on for a few more."""
    from meshspeed import comm

    torch.set_num_threads(1)
    engine = small_engine(stage, gradient_accumulation_steps=gas)
    try:
        for i in range(skip_at + 2 * gas + 1):
            loss = engine(_tokens(i), _tokens(i))
            engine.backward(loss)
            if not (comm.get_rank() == 1 and i == skip_at):
                engine.step()
    except meshspeed.DivergenceError as err:
        return str(err), engine.global_steps
    return None, engine.global_steps


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_rank_that_skips_step_stops_every_rank(stage):
    results = run_distributed(_skip_one_step, world_size=2, args=(stage, 1, 1), timeout=TIMEOUT)
    for rank, (msg, steps) in enumerate(results):
        assert msg is not None, f"rank {rank} went on"
        assert steps == 1  # nobody took a step past the one rank 1 skipped
        lines = [line.strip() for line in msg.splitlines()]
        assert lines[0].startswith("ranks are at different places (a rank skipped engine.step()"), msg
        assert lines[1].startswith("rank 0 is before optimizer step 1 (") and "test_skipped_step.py:" in lines[1]
        assert lines[2].startswith("rank 1 is before the forward of micro-step 1 (no engine.step() after "
                                   "the last backward) ("), msg
        assert "rank 1: global_step 1, micro_step 1, skipped_steps 0   <-- differs" in lines
        assert "rank 0: global_step 1, micro_step 2, skipped_steps 0" in lines


def test_a_skipped_step_inside_an_accumulation_window_stops_every_rank_at_stage3():
    # rank 1 skips the step() of micro-step 2, the first of the second window of 2
    results = run_distributed(_skip_one_step, world_size=2, args=(3, 2, 2), timeout=TIMEOUT)
    for rank, (msg, steps) in enumerate(results):
        assert msg is not None, f"rank {rank} went on"
        assert steps == 1
        lines = [line.strip() for line in msg.splitlines()]
        assert lines[1].startswith("rank 0 is before the forward of micro-step 3 ("), msg
        assert lines[2].startswith("rank 1 is before the forward of micro-step 2 (no engine.step()"), msg
        assert "rank 1: global_step 1, micro_step 2, skipped_steps 0   <-- differs" in lines


def _pipeline_skip():
    """A 2-stage pipeline in which rank 1's step counter falls one behind, as if it had
    skipped one optimizer step (train_batch() cannot leave its step out)."""
    from meshspeed import comm
    from meshspeed.parallel.pipeline.module import PipelineModule

    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = PipelineModule([nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)], num_stages=2, loss_fn=nn.MSELoss())
    engine, *_ = meshspeed.initialize(model=net, config={
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "steps_per_print": 1000})
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(2, 4, generator=g), torch.randn(2, 3, generator=g)) for _ in range(8)]
    engine.train_batch(iter(batches[:2]))
    if comm.get_rank() == 1:
        engine.global_steps -= 1
    try:
        engine.train_batch(iter(batches[2:4]))
    except meshspeed.DivergenceError as err:
        return str(err)
    return None


def test_a_pipeline_stage_a_step_behind_stops_every_rank():
    for rank, msg in enumerate(run_distributed(_pipeline_skip, world_size=2, timeout=TIMEOUT)):
        assert msg is not None, f"rank {rank} went on"
        lines = [line.strip() for line in msg.splitlines()]
        assert "rank 1: global_step 0, micro_step 4, skipped_steps 0   <-- differs" in lines, msg
