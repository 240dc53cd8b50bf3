"""Functions that run on every rank of `run_distributed` (module level, so they pickle)."""

from __future__ import annotations

import copy
import os

import torch

import meshspeed
from meshspeed import comm
from meshspeed.testing.parity import (
    ParitySetup,
    build_model,
    full_state_dict,
    train_steps,
)

GLOBAL_ROWS = 12  # rows per optimizer step, whatever the world size (12 = 1*12 = 2*6 = 3*4 = 4*3)


def setup_for(world: int, stage: int, steps: int = 4, **kw) -> ParitySetup:
    return ParitySetup(steps=steps, world=world, micro=GLOBAL_ROWS // world, stage=stage, seq=8, **kw)


def make_engine(setup: ParitySetup, seed: int = 0):
    model = build_model(setup, seed=seed)
    engine, *_ = meshspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=copy.deepcopy(setup.ds_config()))
    return engine


def train(engine, setup: ParitySetup, first: int, last: int) -> list[float]:
    """Optimizer steps [first, last) of the setup's batches; the global mean loss of each."""
    return train_steps(engine, setup, first, last)


def counters(engine) -> dict:
    return {"global_steps": engine.global_steps, "micro_steps": engine.micro_steps,
            "global_samples": engine.global_samples, "skipped_steps": engine.skipped_steps,
            "scaler": engine.loss_scaler.state_dict()}


# -- exact resume -------------------------------------------------------------------------------
def resume_exact(setups: list[ParitySetup], root: str, n: int, m: int) -> list[dict]:
    """For each setup: N steps, save, M steps; then a fresh engine loads and takes M steps."""
    results = []
    for i, setup in enumerate(setups):
        save_dir = os.path.join(root, f"case{i}")
        a = make_engine(setup)
        train(a, setup, 0, n)
        a.save_checkpoint(save_dir, client_state={"note": "hi", "t": torch.arange(3)})
        saved_counters = counters(a)
        losses_a = train(a, setup, n, n + m)
        state_a = full_state_dict(a)
        b = make_engine(setup, seed=99)  # different initial weights: the load must overwrite them
        path, client = b.load_checkpoint(save_dir)
        loaded_counters = counters(b)
        losses_b = train(b, setup, n, n + m)
        state_b = full_state_dict(b)
        results.append({
            "losses_equal": losses_a == losses_b, "losses": (losses_a, losses_b),
            "params_equal": all(torch.equal(state_a[k], state_b[k]) for k in state_a),
            "counters": (saved_counters, loaded_counters),
            "final_counters": (counters(a), counters(b)),
            "client": (client["note"], client["t"].tolist()), "path": path,
        })
    return results


# -- resharding ---------------------------------------------------------------------------------
def save_after(world: int, stages: list[int], root: str, n: int, steps: int) -> list[str]:
    dirs = []
    for stage in stages:
        setup = setup_for(world, stage, steps=steps)
        engine = make_engine(setup)
        train(engine, setup, 0, n)
        save_dir = os.path.join(root, f"dp{world}-stage{stage}")
        engine.save_checkpoint(save_dir)
        dirs.append(save_dir)
    return dirs


def load_and_continue(world: int, cases: list[tuple[str, int]], n: int, steps: int) -> list:
    """For each (save_dir, stage): a fresh engine at this world size loads and trains on."""
    out = []
    for save_dir, stage in cases:
        setup = setup_for(world, stage, steps=steps)
        engine = make_engine(setup, seed=5)
        engine.load_checkpoint(save_dir)
        assert engine.global_steps == n, engine.global_steps
        losses = train(engine, setup, n, steps)
        out.append((losses, full_state_dict(engine)))
    return out


def mismatch_error(save_dir: str, model_overrides: dict, strict: bool = True) -> str | None:
    """Load `save_dir` into a GPT built with other sizes; the error text, or None."""
    from meshspeed.checkpoint import CheckpointError

    setup = setup_for(comm.get_world_size(), 1, steps=2, model=model_overrides)
    engine = make_engine(setup)
    try:
        engine.load_checkpoint(save_dir, load_module_strict=strict)
    except CheckpointError as err:
        return str(err)
    return None


# -- failures -----------------------------------------------------------------------------------
def load_error(save_dir: str, stage: int = 2) -> str | None:
    from meshspeed.checkpoint import CheckpointError

    engine = make_engine(setup_for(comm.get_world_size(), stage, steps=2))
    try:
        engine.load_checkpoint(save_dir)
    except CheckpointError as err:
        return str(err)
    return None


def save_with_full_disk(save_dir: str, failing_rank: int, async_save: bool = False) -> dict:
    """Save global_step1, then global_step2 while `failing_rank`'s disk is full."""
    import errno

    from meshspeed.checkpoint import CheckpointError, tensorfile
    from meshspeed.checkpoint.engine_api import raise_pending_errors, wait_for_pending
    from meshspeed.checkpoint.pending import in_flight

    extra = {"checkpoint": {"async_save": async_save}}
    setup = setup_for(comm.get_world_size(), 1, steps=3, extra_config=extra)
    engine = make_engine(setup)
    train(engine, setup, 0, 1)
    engine.save_checkpoint(save_dir)
    train(engine, setup, 1, 2)

    def full(f, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    original = tensorfile._write_chunk
    if comm.get_rank() == failing_rank:
        tensorfile._write_chunk = full
    out = {"save": None, "pending": None}
    try:
        engine.save_checkpoint(save_dir)
        while in_flight(engine):  # async: training would go on; here we wait for the outcome
            pass
        raise_pending_errors(engine)
    except CheckpointError as err:
        out["save" if not async_save else "pending"] = str(err)
    finally:
        tensorfile._write_chunk = original
    comm.barrier()
    # the failure was reported; the engine saves normally afterwards
    train(engine, setup, 2, 3)
    engine.save_checkpoint(save_dir)
    wait_for_pending(engine)
    out["steps"] = engine.global_steps
    return out


# -- asynchronous saves -------------------------------------------------------------------------
def async_then_sync(root: str) -> dict:
    """An async save held in the background while training goes on, and the same run saved
    synchronously; both end up in `root`."""
    import threading

    from meshspeed.checkpoint import writer
    from meshspeed.checkpoint.engine_api import wait_for_pending
    from meshspeed.checkpoint.paths import read_latest
    from meshspeed.checkpoint.pending import in_flight

    world = comm.get_world_size()
    release = threading.Event()

    def hold(point: str) -> None:
        if point == "rank_file_written":
            release.wait(60)

    setup = setup_for(world, 3, steps=4, extra_config={"checkpoint": {"async_save": True}})
    a = make_engine(setup)
    train(a, setup, 0, 2)
    original, writer._test_pause = writer._test_pause, hold
    try:
        a.save_checkpoint(f"{root}/async")
        out = {"in_flight": in_flight(a), "latest_during": read_latest(f"{root}/async")}
        losses = train(a, setup, 2, 4)  # training goes on while the save is held
        release.set()
        a.save_checkpoint(f"{root}/async")  # waits for global_step2, then saves global_step4
    finally:
        writer._test_pause = original
    wait_for_pending(a)
    out["latest_after"] = read_latest(f"{root}/async")
    s = make_engine(setup_for(world, 3, steps=4))
    sync_losses = train(s, setup, 0, 4)
    out["losses_equal"] = losses == sync_losses[2:]
    s.save_checkpoint(f"{root}/sync", tag="global_step4")
    return out


# -- consolidation and 16-bit export --------------------------------------------------------------
def save_for_export(root: str) -> dict:
    """ZeRO-3, tied embeddings: a checkpoint, the gathered state_dict, and save_16bit_model,
    in fp32 and in bf16."""
    from meshspeed.zero import GatheredParameters

    out = {}
    for precision in ("fp32", "bf16"):
        setup = setup_for(comm.get_world_size(), 3, steps=2, tie=True, precision=precision)
        engine = make_engine(setup)
        train(engine, setup, 0, 2)
        engine.save_checkpoint(f"{root}/{precision}")
        module = engine.module
        sharded_numel = sum(p.data.numel() for p in module.parameters() if p.data.untyped_storage().nbytes())
        with GatheredParameters(list(module.parameters())):
            state = {k: v.detach().clone() for k, v in module.state_dict().items()}
        path = engine.save_16bit_model(f"{root}/{precision}-export")
        out[precision] = {"state": state, "file": path, "resident_numel_outside": sharded_numel}
    return out


class Wide(torch.nn.Module):
    """48 MiB of fp32 parameters, each 4 or 8 MiB: for the memory bound of `convert`."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.ModuleList(torch.nn.Linear(1024, 1024, bias=False) for _ in range(10))
        self.b = torch.nn.Linear(1024, 2048, bias=False)

    def forward(self, x):
        return x


def save_wide(root: str) -> str:
    torch.manual_seed(0)
    model = Wide()
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2},
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, *_ = meshspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    engine.save_checkpoint(root)
    return root


def sampler_epoch_round_trip() -> tuple[int, int, int]:
    """A DistributedSampler's epoch and the sample counters survive save and load."""
    import tempfile

    from torch.utils.data import TensorDataset

    setup = setup_for(comm.get_world_size(), 2, steps=2)
    data = TensorDataset(torch.randint(0, 64, (48, setup.seq + 1)))
    save_dir = comm.broadcast_object(tempfile.mkdtemp(), src=0)
    engines = []
    for seed in (0, 1):
        model = build_model(setup, seed=seed)
        engine, *_ = meshspeed.initialize(model=model, model_parameters=model.parameters(),
                                                    config=setup.ds_config(), training_data=data)
        engines.append(engine)
    a, b = engines
    a.training_dataloader.sampler.set_epoch(3)
    train(a, setup, 0, 2)
    a.save_checkpoint(save_dir)
    b.load_checkpoint(save_dir)
    return b.training_dataloader.sampler.epoch, b.global_samples, b.micro_steps


def async_failure_surfaces_in_step(save_dir: str) -> str | None:
    """An async save fails on rank 1 (full disk); the next engine.step() must raise it."""
    import errno

    from meshspeed.checkpoint import CheckpointError, tensorfile
    from meshspeed.checkpoint.pending import in_flight, wait_for_pending

    setup = setup_for(comm.get_world_size(), 1, steps=2,
                      extra_config={"checkpoint": {"async_save": True}})
    engine = make_engine(setup)
    train(engine, setup, 0, 1)

    def full(f, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    original = tensorfile._write_chunk
    if comm.get_rank() == 1:
        tensorfile._write_chunk = full
    try:
        engine.save_checkpoint(save_dir)
        while in_flight(engine):
            pass
    finally:
        tensorfile._write_chunk = original
    comm.barrier()
    try:
        train(engine, setup, 1, 2)
    except CheckpointError as err:
        return str(err)
    finally:
        try:
            wait_for_pending(engine)
        except CheckpointError:
            pass
    return None
