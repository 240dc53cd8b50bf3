"""A checkpoint of a pipelined run loads at another pp, tp and dp, and without a pipeline
(Note [a checkpoint of pipeline stages] in meshspeed/checkpoint/snapshot.py): after loading,
the next steps' losses and the final parameters equal those of the run that saved."""

import copy

import torch

import meshspeed
from meshspeed.testing import run_distributed
from meshspeed.testing.parity import (
    ParitySetup,
    build_model,
    make_batches,
    pipeline_state_dict,
    train_batches,
)

BASE = {"steps": 4, "gas": 4, "seq": 8, "model": {"n_layer": 4}}


def _setup(world, pp, tp=1, stage=0, tie=True):
    dp = world // (pp * tp)
    return ParitySetup(world=world, pp=pp, tp=tp, stage=stage, tie=tie, micro=2 // dp, **BASE)


def _engine(setup):
    model = build_model(setup, stages=setup.pp)
    return meshspeed.initialize(model=model, config=copy.deepcopy(setup.ds_config()))[0]


def _save(root):
    out = {}
    for tie in (True, False):
        engine = _engine(_setup(2, pp=2, tie=tie))
        setup = _setup(2, pp=2, tie=tie)
        train_batches(engine, setup, 0, 2)
        engine.save_checkpoint(f"{root}/{tie}", tag="t")
        out[tie] = (train_batches(engine, setup, 2, 4), pipeline_state_dict(engine))
    return out


def _load(root, setups):
    out = []
    for setup in setups:
        engine = _engine(setup)
        engine.load_checkpoint(f"{root}/{setup.tie}", tag="t")
        out.append((train_batches(engine, setup, 2, 4), pipeline_state_dict(engine)))
    return out


def _load_without_pipeline(root):
    """Into the one-stage pipeline form on 2 data-parallel ranks: a plain engine."""
    setup = _setup(2, pp=1)
    setup.pp, setup.micro = 2, 2  # the pipeline form (built with one stage here); 2 rows a micro-batch
    model = build_model(setup, stages=1)
    cfg = copy.deepcopy(setup.ds_config())
    cfg.pop("pipeline")
    cfg["train_micro_batch_size_per_gpu"] = 1
    engine = meshspeed.initialize(model=model, config=cfg)[0]
    engine.load_checkpoint(f"{root}/True", tag="t")
    rank = engine.mesh.coord("dp")
    losses = []
    for batch in make_batches(setup)[2:4]:
        total = torch.zeros(())
        for micro in batch:
            tokens = micro[rank : rank + 1]
            loss = engine.module.loss_fn(engine(tokens[:, :-1]), tokens[:, 1:])
            engine.backward(loss)
            engine.step()
            total += loss.detach()
        meshspeed.comm.all_reduce(total)
        losses.append(total.item() / (2 * setup.gas))
    return losses, {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def _close(got, want):
    torch.testing.assert_close(torch.tensor(got[0]), torch.tensor(want[0]), rtol=1e-5, atol=1e-6)
    assert got[1].keys() == want[1].keys()
    for name in want[1]:
        torch.testing.assert_close(got[1][name], want[1][name], rtol=1e-5, atol=1e-6,
                                   msg=lambda m, n=name: f"{n}: {m}")


def test_pipelined_checkpoint_loads_at_other_layouts(tmp_path):
    root = str(tmp_path)
    saved = run_distributed(_save, world_size=2, args=(root,))[0]
    elsewhere = [_setup(4, pp=2, stage=2), _setup(4, pp=4), _setup(4, pp=2, tp=2, stage=1, tie=False)]
    for setup, got in zip(elsewhere, run_distributed(_load, world_size=4, args=(root, elsewhere))[0]):
        _close(got, saved[setup.tie])
    same = _setup(2, pp=2, stage=3)
    _close(run_distributed(_load, world_size=2, args=(root, [same]))[0][0], saved[True])
    _close(run_distributed(_load_without_pipeline, world_size=2, args=(root,))[0], saved[True])
