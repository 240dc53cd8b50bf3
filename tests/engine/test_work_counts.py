"""The step's work, held to a committed baseline in deterministic units (Note [work
counts] in meshspeed/testing/work.py): a guard against the core growing slower that does
not read a clock. Every protection is on (the step agreement, the collective digest, call
sites); the model is small so the test is quick, and the counts are per optimizer step on
rank 0 of 2 gloo ranks.

A count more than 10% over tests/engine/work_counts.json fails. When a change adds work on
purpose, update the baseline deliberately, with the reason in the commit message:

    .venv/bin/python -m tests.engine.test_work_counts --update
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest

from meshspeed.testing import run_distributed
from meshspeed.testing.parity import ParitySetup, build_model, make_batches, model_loss

BASELINE = Path(__file__).with_name("work_counts.json")
GROWTH = 1.10  # a count may grow by up to 10% before the test fails
BASE = {"model": {"n_layer": 2, "d_model": 64, "n_head": 4}, "seq": 32, "micro": 2, "steps": 1}
CASES = {  # name -> ParitySetup fields, all on 2 ranks
    "zero0": {"stage": 0},
    "zero1": {"stage": 1},
    "zero2": {"stage": 2},
    "zero3": {"stage": 3},
    "tp2": {"tp": 2, "sequence_parallel": True},
    "pp2-1f1b": {"pp": 2, "gas": 4},
    "ulysses2": {"cp": 2, "cp_mode": "ulysses"},
    "moe-ep2": {"model": {**BASE["model"], "moe_num_experts": 4, "moe_ep_size": 2}},
}


def _setup(name: str) -> ParitySetup:
    fields = {**BASE, **CASES[name]}
    return ParitySetup(world=2, **fields)


def _count(name: str) -> dict[str, int]:
    import torch

    import meshspeed
    from meshspeed.testing.work import count_step_work

    torch.set_num_threads(1)
    setup = _setup(name)
    model = build_model(setup, stages=setup.pp)
    engine, *_ = meshspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=copy.deepcopy(setup.ds_config()))
    batch = make_batches(setup)[0]
    rank = engine.mesh.coord("dp")
    rows = slice(rank * setup.micro, (rank + 1) * setup.micro)
    if setup.pp > 1:
        micro = [(m[rows][:, :-1], m[rows][:, 1:]) for m in batch]
        return count_step_work(lambda: engine.train_batch(iter(micro)))

    def step():
        for m in batch:
            engine.backward(model_loss(setup, engine, m[rows]))
            engine.step()

    return count_step_work(step)


def measure(name: str) -> dict[str, int]:
    return run_distributed(_count, world_size=2, args=(name,))[0]


@pytest.fixture(scope="module")
def baseline() -> dict:
    return json.loads(BASELINE.read_text())


@pytest.mark.parametrize("name", CASES)
def test_the_step_does_no_more_work_than_the_baseline(name, baseline):
    got, want = measure(name), baseline[name]
    grown = {k: (want[k], got[k]) for k in want if got[k] > GROWTH * want[k]}
    assert not grown, (f"{name}: work per step grew more than {GROWTH - 1:.0%} over "
                       f"tests/engine/work_counts.json (baseline, now): {grown}; if on purpose, "
                       "update the baseline (this file's docstring says how) and say why in the commit")


def test_the_counts_are_deterministic():
    """The guard's premise: the same step counts the same twice."""
    assert measure("zero2") == measure("zero2")


if __name__ == "__main__":
    if sys.argv[1:] in (["-h"], ["--help"]):
        sys.exit(print(__doc__))
    if sys.argv[1:] != ["--update"]:
        raise SystemExit(__doc__)
    BASELINE.write_text(json.dumps({name: measure(name) for name in CASES}, indent=1) + "\n")
    print(f"wrote {BASELINE}")
