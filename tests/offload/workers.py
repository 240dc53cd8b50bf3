"""Functions the offload tests run on gloo ranks (module level: they travel by reference)."""

from __future__ import annotations

import copy
import gc
import os
import threading
import time

import torch

from meshspeed import comm
from meshspeed.offload import close
from meshspeed.testing.parity import (
    ParitySetup,
    build_model,
    engine_run,
    full_state_dict,
    make_batches,
    model_loss,
)


def offload(device: str, nvme_path: str | None = None, **extra) -> dict:
    """`extra_config` fragment for ParitySetup: offload the optimizer to `device`."""
    block = {"device": device, **extra}
    if nvme_path is not None:
        block["nvme_path"] = nvme_path
    return {"offload_optimizer": block}


def setup(stage: int, zero: dict | None = None, **kw) -> ParitySetup:
    extra = dict(kw.pop("extra_config", {}))
    if zero:
        extra["zero_optimization"] = zero
    return ParitySetup(stage=stage, world=kw.pop("world", 2), steps=kw.pop("steps", 6),
                       extra_config=extra, **kw)


def exact_adamw() -> dict:
    """The parity helper's AdamW with torch's reference kernel instead of the fused one."""
    return {"optimizer": {"type": "AdamW",
                          "params": {"lr": 1e-3, "weight_decay": 0.1, "eps": 1e-6, "fused": False}}}


def runs_and_cleanup(setups: list[ParitySetup]) -> list:
    """engine_run for each setup; collects engines so swap directories are removed. A
    read-ahead thread still reading (Note [the step's I/O outside the step] in
    meshspeed/offload/state.py) holds its store, and the store its directory, until its
    reads complete: join those threads first."""
    out = [engine_run(s) for s in setups]
    gc.collect()
    # (a delayed update's background step may start one while we look: a thread just
    # started cannot be joined yet, and one may start after the first look)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        ahead = [t for t in threading.enumerate() if t.name == "meshspeed-offload-read-ahead"]
        if not ahead:
            break
        for thread in ahead:
            try:
                thread.join(timeout=1.0)
            except RuntimeError:  # started, not yet running
                time.sleep(0.01)
    gc.collect()
    return out


def _engine(s: ParitySetup):
    import meshspeed

    model = build_model(s)
    engine, *_ = meshspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=copy.deepcopy(s.ds_config()))
    return engine


def _train(engine, s: ParitySetup, steps: int | None = None) -> list[float]:
    return _train_batches(engine, s, make_batches(s)[:steps])


def delayed_reference(s: ParitySetup) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, the update applied one step late (Note [delayed parameter update]):
    gradient N is taken at the parameters published after step N-1 and applied to the
    masters of step N; returns the losses and the *published* parameters at the end."""
    model = build_model(s)
    master = copy.deepcopy(model)
    params = [p for p in model.parameters() if p.requires_grad]
    masters = [p for p in master.parameters() if p.requires_grad]
    block = s.optimizer_block()
    opt = torch.optim.AdamW(masters, **block["params"])
    losses = []
    for batch in make_batches(s):
        tokens = batch.reshape(-1, s.seq + 1)
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        if s.clip > 0:
            torch.nn.utils.clip_grad_norm_(params, s.clip)
        published = [m.detach().clone() for m in masters]  # M_N: what forward N+1 sees
        for m, p in zip(masters, params):
            m.grad = p.grad
        opt.step()
        with torch.no_grad():
            for p, value in zip(params, published):
                p.copy_(value)
                p.grad = None
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def delayed_flush(s: ParitySetup) -> tuple[dict, dict]:
    """Train with delayed updates; parameters before and after `flush`."""
    from meshspeed.offload import flush

    engine = _engine(s)
    _train(engine, s)
    before = full_state_dict(engine)
    flush(engine)
    after = full_state_dict(engine)
    masters = {sl.name: sl.master.detach().clone() for sl in engine.strategy.owned_slices()}
    own = {}
    for sl in engine.strategy.owned_slices():
        own[sl.name] = after[sl.name].reshape(-1)[sl.start : sl.end].clone()
    close(engine)
    return before, after, masters, own


def breakdown(s: ParitySetup, steps: int = 2) -> dict:
    """memory_breakdown after a few steps, with the numbers the tests compare it to."""
    engine = _engine(s)
    _train(engine, s, steps)
    mem = engine.memory_breakdown()
    owned = sum(sl.end - sl.start for sl in engine.strategy.owned_slices() if sl.requires_grad)
    grad_staging = sum(t.untyped_storage().nbytes() for t in engine.strategy.placement.grad_staging())
    files = 0
    swap_dirs = getattr(engine.strategy.placement, "swap_dirs", {})  # offloaded runs only
    swap_root = next((d.path for d in swap_dirs.values()), None)
    if swap_root is not None:
        for root, _, names in os.walk(swap_root):
            files += sum(os.path.getsize(os.path.join(root, n)) for n in names)
    close(engine)
    return {"mem": mem, "owned": owned, "files": files, "swap_root": swap_root, "grad_staging": grad_staging,
            "removed": swap_root is not None and not os.path.exists(swap_root)}


def checkpoint_roundtrip(s: ParitySetup, save_dir: str) -> tuple[list[float], list[float]]:
    """Train 3 steps, save, train 3 more; a fresh engine loads and trains the same 3."""
    engine = _engine(s)
    _train(engine, s, 3)
    engine.save_checkpoint(save_dir, tag="t")
    rest = make_batches(s)[3:]
    tail = _train_batches(engine, s, rest)
    close(engine)
    fresh = _engine(s)
    fresh.load_checkpoint(save_dir, tag="t")
    again = _train_batches(fresh, s, rest)
    close(fresh)
    return tail, again


def _train_batches(engine, s, batches) -> list[float]:
    from meshspeed import comm

    rank = comm.get_rank()
    rows = slice(rank * s.micro, (rank + 1) * s.micro)
    losses = []
    for batch in batches:
        for micro in batch:
            tokens = micro[rows]
            loss = engine(tokens[:, :-1], tokens[:, 1:])
            engine.backward(loss)
            engine.step()
        losses.append(loss.item())
    return losses


def initialize_error(config: dict) -> str:
    """The ConfigError message initialize raises for `config` on this rank ('' if none)."""
    import meshspeed
    from meshspeed.config import ConfigError

    s = ParitySetup()
    model = build_model(s)
    try:
        meshspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    except ConfigError as err:
        return str(err)
    return ""


__all__ = ["engine_run", "full_state_dict"]


def initialize_error_one_rank_bad(good_dir: str) -> str:
    """Rank 0 gets a usable nvme_path, the others a missing one: every rank must raise."""
    from meshspeed import comm

    path = good_dir if comm.get_rank() == 0 else os.path.join(good_dir, "missing")
    config = setup(2, offload("nvme", path)).ds_config()
    return initialize_error(config)


def grads_moved_during_backward(s: ParitySetup) -> tuple[int, int]:
    """After the boundary backward (before step): how many units' gradients already sit in
    their host buffers, out of how many units."""
    engine = _engine(s)
    batch = make_batches(s)[0][0]
    rows = batch[comm.get_rank() * s.micro:(comm.get_rank() + 1) * s.micro]
    engine.backward(engine(rows[:, :-1], rows[:, 1:]))
    moved = len(engine.strategy.placement.grads_on_host)
    engine.step()
    return moved, len(engine.strategy.units)


def masters_on_disk(s: ParitySetup) -> dict:
    """After two steps: where the masters are (bytes of placeholders and of their files)."""
    engine = _engine(s)
    _train(engine, s, 2)
    placement = engine.strategy.placement
    files = placement.master_files
    masters = engine.strategy.masters()
    out = {"mem": engine.memory_breakdown(), "owned": sum(m.numel() for m in masters),
           "held": all(files.holds(m) for m in masters) if files else False,
           "placeholder_bytes": sum(m.untyped_storage().nbytes() for m in masters),
           "unit_buffers": sum(u.master_buffer is not None for u in engine.strategy.units),
           "files": files.nvme_bytes() if files else 0}
    close(engine)
    return out


def peak_rss_growth(s: ParitySetup, steps: int, warmup: ParitySetup) -> dict:
    """Train `steps` steps in this (one-rank) process, sampling RSS every 5 ms from before
    the model is built; returns the peak growth and the model's size. `warmup` (a tiny
    model, same config) runs first, so code loaded on first use is not counted."""
    import threading
    import time

    engine = _engine(warmup)
    _train(engine, warmup, steps)
    close(engine)
    del engine

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    gc.collect()
    start, peak, stop = rss(), [0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.005)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        engine = _engine(s)
        losses = _train(engine, s, steps)
        numel = sum(u.layout.numel for u in engine.strategy.units)
        close(engine)
    finally:
        stop.set()
        thread.join()
    return {"growth": peak[0] - start, "numel": numel, "losses": losses}


def skipped_run(s: ParitySetup) -> tuple[list[float], dict[str, torch.Tensor], int, float | None]:
    """engine_run plus the engine's skipped-step count and last gradient norm."""
    engine = _engine(s)
    losses = _train(engine, s)
    out = (losses, full_state_dict(engine), engine.skipped_steps, engine.get_global_grad_norm())
    close(engine)
    return out


def grads_between_backward_and_step(s: ParitySetup) -> dict:
    """safe_get_full_grad after the boundary backward (before step), the breakdown after
    the step, and the gradient files' size on this rank."""
    from meshspeed.utils import safe_get_full_grad

    engine = _engine(s)
    batch = make_batches(s)[0][0][engine.mesh.coord("dp") * s.micro:][: s.micro]
    engine.backward(model_loss(s, engine, batch))
    grads = {n: safe_get_full_grad(p) for n, p in engine.module.named_parameters()}
    engine.step()
    placement = engine.strategy.placement
    files = getattr(placement, "grad_files", None)
    out = {"grads": grads, "mem": engine.memory_breakdown(),
           "grad_files": 0 if files is None else files.nvme_bytes(),
           "owned": sum(sl.end - sl.start for sl in engine.strategy.owned_slices() if sl.requires_grad)}
    close(engine)
    return out


def checkpoint_heap_peak(s: ParitySetup, save_dir: str) -> dict:
    """Train 2 steps, save, train the rest; a fresh engine loads and trains the same rest.
    Also measured: the most host memory held above the start of the save (sampled at
    every write of the checkpoint file) and of the load (at every read of it), with what
    to compare them to: the bytes of swapped state this rank saves (fp32 masters + moments)
    and of its largest single range."""
    from meshspeed.checkpoint import tensorfile
    from tests.offload.heap import HeapPeak

    engine = _engine(s)
    _train(engine, s, 2)
    ranges = [4 * (sl.end - sl.start) for sl in engine.strategy.owned_slices()]
    tensors_per_range = 1 + len(engine.optimizer.store.rule.state_keys)  # master + moments
    gc.collect()
    with HeapPeak([(tensorfile, "_write_chunk")]) as save:
        engine.save_checkpoint(save_dir, tag="t")
    published = os.path.exists(os.path.join(save_dir, "t", "meta.json"))  # before any wait
    rest = make_batches(s)[2:]
    tail = _train_batches(engine, s, rest)
    final = full_state_dict(engine)
    close(engine)
    del engine
    fresh = _engine(s)
    gc.collect()
    with HeapPeak([(tensorfile.TensorFile, "read_into")]) as load:
        fresh.load_checkpoint(save_dir, tag="t")
    again = _train_batches(fresh, s, rest)
    final_again = full_state_dict(fresh)
    close(fresh)
    return {"save": save.growth, "load": load.growth, "state": tensors_per_range * sum(ranges),
            "largest": max(ranges), "published": published, "losses": (tail, again),
            "params_equal": all(torch.equal(final[k], final_again[k]) for k in final)}


def train_counting_last_step(engine, s: ParitySetup) -> tuple[list[float], dict[str, int]]:
    """Train the setup's batches; the losses, and the bytes this rank's swap engines read
    and wrote in the last step alone (a step's write-back and the next step's read-ahead
    run after it returns: `settle` on both sides of the step)."""
    from meshspeed.offload.aio import io_totals

    batches = make_batches(s)
    losses = _train_batches(engine, s, batches[:-1])
    engine.optimizer.settle()
    before = io_totals()
    losses += _train_batches(engine, s, batches[-1:])
    engine.optimizer.settle()
    after = io_totals()
    return losses, {k: after[k] - before[k] for k in ("read", "write")}


def io_per_step(s: ParitySetup) -> dict:
    """Bytes this rank's swap engines read and wrote in its last step, and what it owns."""
    engine = _engine(s)
    _, moved = train_counting_last_step(engine, s)
    owned = sum(sl.end - sl.start for sl in engine.strategy.owned_slices())
    close(engine)
    return {**moved, "owned": owned}
