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
    assert "rank 1: collective #1 broadcast(shape=(7,), dtype=float32)   <-- differs" in lines
    assert "rank 0: collective #1 all_reduce(shape=(4,), dtype=float32)" in lines
    assert "seen from rank 2" in messages[2]
