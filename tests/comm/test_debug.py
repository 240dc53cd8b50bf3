"""MESHSPEED_COMM_DEBUG=1: diverged ranks raise a clear error instead of hanging."""

from __future__ import annotations

import os

import torch

from meshspeed import comm
from meshspeed.comm import CollectiveMismatchError


def _matching_body():
    os.environ["MESHSPEED_COMM_DEBUG"] = "1"  # the harness restores the environment after
    t = torch.ones(4)
    comm.all_reduce(t)
    comm.broadcast(t, src=0)
    out = torch.empty(2 * comm.get_world_size())
    comm.all_gather_into_tensor(out, torch.ones(2))
    return t.tolist()


def _diverged_body():
    os.environ["MESHSPEED_COMM_DEBUG"] = "1"
    comm.all_reduce(torch.ones(4))  # call #0 matches
    try:
        if comm.get_rank() == 1:
            comm.broadcast(torch.ones(7), src=0)
        else:
            comm.all_reduce(torch.ones(4))
    except CollectiveMismatchError as exc:
        return str(exc)
    return None


def test_matching_collectives_pass_the_check():
    from meshspeed.testing import run_distributed

    assert run_distributed(_matching_body, 2) == [[2.0] * 4] * 2


def test_diverged_ranks_raise_on_every_rank():
    from meshspeed.testing import run_distributed

    messages = run_distributed(_diverged_body, 3)
    assert all(m is not None for m in messages)
    lines = [line.strip() for line in messages[0].splitlines()]
    site = "tests/comm/test_debug.py"
    assert any(line.startswith("rank 1: collective #1 broadcast(shape=(7,), dtype=float32) at " + site)
               and line.endswith("<-- differs") for line in lines), lines
    assert any(line.startswith("rank 0: collective #1 all_reduce(shape=(4,), dtype=float32) at " + site)
               and "differs" not in line for line in lines), lines
    assert "seen from rank 2" in messages[2]


def _only_rank0_saves(save_dir):
    """Issue 9 case 3: only rank 0 calls save_checkpoint under the debug mode."""
    from meshspeed.testing.engines import small_engine, train_step

    os.environ["MESHSPEED_COMM_DEBUG"] = "1"
    engine = small_engine()
    train_step(engine, torch.randint(0, 16, (1, 4)))
    try:
        if comm.get_rank() == 0:
            engine.save_checkpoint(save_dir)
        else:
            comm.all_reduce(torch.ones(3))  # rank 1 went on training
    except CollectiveMismatchError as exc:
        return type(exc).__name__, str(exc)
    except Exception as exc:  # noqa: BLE001 - the test reports what it was
        return type(exc).__name__, str(exc)
    return None


def test_a_rank_skipping_a_save_is_reported_not_crashed(tmp_path):
    from meshspeed.testing import run_distributed

    (kind0, msg0), (kind1, msg1) = run_distributed(_only_rank0_saves, 2, args=(str(tmp_path),), timeout=60)
    # rank 1 (in the debug check) names both sides; rank 0's save fails loudly too, with
    # rank 1's fingerprint in its message (it received it instead of the save's data)
    assert kind1 == "CollectiveMismatchError", msg1
    assert "rank 0: not at a checked collective" in msg1
    assert "rank 1: collective #" in msg1 and "all_reduce(shape=(3,)" in msg1
    assert kind0 in ("CollectiveMismatchError", "CheckpointError") and "all_reduce" in msg0, msg0
