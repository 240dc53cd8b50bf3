"""Resharding on load: a checkpoint saved at (dp=a, ZeRO stage s) loads at (dp=b, stage t)
with no conversion step, optimizer state included, and training continues as if the layout
had never changed (compared with a one-process reference, fp32 tolerance).

Every case keeps the global batch (12 rows) fixed, so one reference run serves them all.
Runs are grouped by world size to start few worker pools: saves at dp=4 load at dp=1, saves
at dp=1 load at dp=4, saves at dp=2 load at dp=3.
"""

from __future__ import annotations

import pytest

from meshspeed.testing.harness import run_distributed
from meshspeed.testing.parity import assert_close_parity, reference_run
from tests.checkpoint import workers

N, STEPS = 2, 4  # save after N steps, continue to STEPS
STAGES = range(4)
# (saved dp, loaded dp) -> [(saved stage, loaded stage)]
MATRIX = {
    (4, 1): [(s, t) for s in STAGES for t in STAGES],
    (1, 4): [(0, 3), (3, 1), (2, 2)],
    (2, 3): [(s, t) for s in STAGES for t in STAGES],
}
CASES = [(a, b, s, t) for (a, b), pairs in MATRIX.items() for s, t in pairs]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("reshard"))
    out = {}
    for (a, b), pairs in MATRIX.items():
        saved_stages = sorted({s for s, _ in pairs})
        dirs = run_distributed(workers.save_after, a, args=(a, saved_stages, root, N, STEPS))[0]
        dir_of = dict(zip(saved_stages, dirs))
        cases = [(dir_of[s], t) for s, t in pairs]
        results = run_distributed(workers.load_and_continue, b, args=(b, cases, N, STEPS))[0]
        out.update({(a, b, s, t): r for (s, t), r in zip(pairs, results)})
    out["root"] = root
    return out


@pytest.fixture(scope="module")
def reference():
    losses, state = reference_run(workers.setup_for(1, 0, steps=STEPS))
    return losses[N:], state


@pytest.mark.parametrize("a,b,s,t", CASES, ids=[f"dp{a}s{s}-to-dp{b}s{t}" for a, b, s, t in CASES])
def test_resumes_in_another_layout(runs, reference, a, b, s, t):
    assert_close_parity(reference, runs[(a, b, s, t)])


def test_different_model_names_first_mismatch(runs):
    save_dir = f"{runs['root']}/dp2-stage1"
    errors = run_distributed(workers.mismatch_error, 2, args=(save_dir, {"vocab_size": 80}))
    assert errors[0] == errors[1]
    msg = errors[0]
    assert msg is not None and "\n" not in msg
    assert "'tok_emb.weight'" in msg and "(64, 32)" in msg and "(80, 32)" in msg, msg


def test_missing_parameters_strict_and_not(runs):
    save_dir = f"{runs['root']}/dp2-stage1"
    strict = run_distributed(workers.mismatch_error, 2, args=(save_dir, {"n_layer": 3}))[0]
    assert strict is not None and "'layers.2." in strict and "load_module_strict=False" in strict
    loose = run_distributed(workers.mismatch_error, 2, args=(save_dir, {"n_layer": 3}, False))[0]
    assert loose is None
