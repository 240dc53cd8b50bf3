"""Functions that run on every rank of `run_distributed` (module level, so they pickle)."""

from __future__ import annotations

import copy
import math
import os

import torch

import meshspeed
from meshspeed import comm
from meshspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from meshspeed.testing.parity import ParitySetup, build_model, train_steps


def gathered_masters(engine) -> dict[str, torch.Tensor]:
    """Each parameter's fp32 master, assembled from every rank's owned ranges."""
    mine = [(s.name, tuple(s.shape), s.start, s.end, s.master.detach().float().clone())
            for s in engine.strategy.owned_slices()]
    shapes, full = {}, {}
    for ranks_slices in comm.all_gather_object(mine):
        for name, shape, start, end, values in ranks_slices:
            shapes[name] = shape
            full.setdefault(name, torch.full((math.prod(shape),), float("nan")))[start:end] = values
    return {name: flat.view(shapes[name]) for name, flat in full.items()}


def setup_for(stage: int) -> ParitySetup:
    # bf16 compute: the masters (fp32) differ from the parameters, so the test tells them
    # apart; tied embeddings and a frozen block exercise aliases and frozen parameters
    return ParitySetup(steps=2, world=comm.get_world_size(), micro=2, seq=8, stage=stage,
                       precision="bf16", tie=True, frozen=True, model={"n_layer": 1, "d_model": 16})


def client_engine(setup: ParitySetup, kind: str):
    model = build_model(setup)
    trainable = [p for p in model.parameters() if p.requires_grad]
    block = setup.optimizer_block()["params"]
    if kind == "FusedAdam":
        opt = FusedAdam(trainable, lr=block["lr"], eps=block["eps"], weight_decay=block["weight_decay"])
    else:
        opt = DeepSpeedCPUAdam(trainable, lr=block["lr"], eps=block["eps"],
                               weight_decay=block["weight_decay"], adamw_mode=True)
    config = {k: v for k, v in copy.deepcopy(setup.ds_config()).items() if k != "optimizer"}
    engine, optimizer, _, _ = meshspeed.initialize(model=model, optimizer=opt, config=config)
    assert optimizer is opt and engine.optimizer is opt
    return engine


def config_engine(setup: ParitySetup):
    model = build_model(setup)
    engine, *_ = meshspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=copy.deepcopy(setup.ds_config()))
    return engine


def save_at_every_stage(root: str) -> list[dict]:
    """For stages 0-3: a DeepSpeed Adam class adopted by the engine, two steps, a checkpoint,
    and the gathered fp32 masters; plus the same run with the config's AdamW."""
    out = []
    for stage in range(4):
        setup = setup_for(stage)
        kind = "FusedAdam" if stage % 2 == 0 else "DeepSpeedCPUAdam"
        engine = client_engine(setup, kind)
        losses = train_steps(engine, setup)
        engine.save_checkpoint(os.path.join(root, f"stage{stage}"))
        masters = gathered_masters(engine)
        reference_engine = config_engine(setup)
        train_steps(reference_engine, setup)
        reference = gathered_masters(reference_engine)
        out.append({"stage": stage, "kind": kind, "losses": losses, "masters": masters,
                    "reference": reference,
                    "param_dtype": str(next(engine.module.parameters()).dtype)})
    return out

