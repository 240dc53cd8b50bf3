"""Partial residency (meshspeed/offload/residency.py) and shards kept from forward to
backward (param.py): fewer bytes through the swap engine, the same bits."""

from types import SimpleNamespace

import torch

from meshspeed.config import MeshspeedConfig
from meshspeed.offload.aio import SwapEngine, io_totals
from meshspeed.offload.hostmem import round_up
from meshspeed.offload.param import NvmeShardStore
from meshspeed.offload.residency import (
    OPTIMIZER_BYTES,
    UNCOUNTED,
    residency_budget,
    split_budget,
    user_limits,
)
from meshspeed.planner.fit import INTERPRETER
from meshspeed.testing import run_distributed
from meshspeed.testing.parity import full_state_dict, make_batches
from tests.offload.workers import (
    _engine,
    _train_batches,
    exact_adamw,
    offload,
    setup,
    train_counting_last_step,
)


def test_budget_is_the_share_above_the_peak_less_headroom():
    gib = 2**30
    # the peak the buffer defaults aim at: min(8 GiB, half the rank's share), less the
    # interpreter and what neither counts
    assert residency_budget(4 * gib, available=20 * gib, local_ranks=1) == int(8 * gib - INTERPRETER - UNCOUNTED - 4 * gib)
    assert residency_budget(1 * gib, available=64 * gib, local_ranks=4) == int(8 * gib - INTERPRETER - UNCOUNTED - gib)
    assert residency_budget(1 * gib, available=16 * gib, local_ranks=2) == int(4 * gib - INTERPRETER - UNCOUNTED - gib)
    assert residency_budget(1 * gib, available=8 * gib, local_ranks=2) == 0  # 2 GiB aimed at: no room
    assert residency_budget(9 * gib, available=8 * gib, local_ranks=1) == 0


def test_split_gives_shards_first_and_keeps_what_the_user_set():
    plan = split_budget(2 * 1000 + OPTIMIZER_BYTES * 50 + 7, shard_elements=1000, shard_bytes=2,
                        optimizer_elements=400, param_limit=None, optimizer_limit=None)
    assert (plan.param_elements, plan.optimizer_elements, plan.keep_bytes) == (1000, 50, 0)
    plan = split_budget(10**9, shard_elements=1000, shard_bytes=2, optimizer_elements=400,
                        param_limit=100, optimizer_limit=0)
    assert (plan.param_elements, plan.optimizer_elements) == (100, 0)
    assert plan.keep_bytes == 900 * 2  # the rest of the shards, kept from forward to backward


def test_unset_max_in_cpu_is_not_deepspeeds_default():
    def cfg(param, opt):
        return MeshspeedConfig.checked({"train_batch_size": 1, "zero_optimization": {
            "stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/tmp", **param},
            "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp", **opt}}})
    assert user_limits(cfg({}, {})) == (None, None)
    assert user_limits(cfg({"max_in_cpu": 1_000_000_000}, {"max_in_cpu": 0})) == (1_000_000_000, 0)


def _units():
    g = torch.Generator().manual_seed(0)
    return [SimpleNamespace(shard=torch.randn(n, generator=g).to(torch.bfloat16), device=torch.device("cpu"))
            for n in (1000, 2048, 2048, 512)]


def _reads(store, units, order, into=False):
    before = io_totals()["read"]
    for i in order:
        got = store.fetch(units[i], into=torch.empty(store.numel[i], dtype=torch.bfloat16) if into else None)
        yield i, got.clone()  # (a pool buffer's view, reused once done)
        store.done(units[i])
    yield None, io_totals()["read"] - before


def _steps(tmp_path, keep):
    """Three steps of forward, backward, write on a store with units 0 and 3 resident;
    the bytes read in each and whether every fetch gave the values last written."""
    units = _units()
    want = [u.shard.clone() for u in units]
    store = NvmeShardStore(units, str(tmp_path), SwapEngine(), buffer_count=2, buffer_numel=2048, pin=False)
    assert store.make_resident(1000 + 512) == [0, 3]  # greedy in build order: 0 and 3 fit
    assert not (tmp_path / "unit0.shard").exists() and (tmp_path / "unit1.shard").exists()
    store.keep(keep)
    reads, same = [], True
    for _ in range(3):
        *got, (_, read) = _reads(store, units, [0, 1, 2, 3, 3, 2, 1, 0])
        same = same and all(torch.equal(g, want[i]) for i, g in got)
        reads.append(read)
        for i in range(4):  # a write updates the in-memory copies and the files alike
            want[i] = torch.randn(store.numel[i]).to(torch.bfloat16)
            store.write(units[i], want[i].float())
    store.keep(0)
    *got, (_, read) = _reads(store, units, [0, 1, 2, 3], into=True)
    same = same and all(torch.equal(g, want[i]) for i, g in got)
    store.close()
    return reads, same


def test_resident_and_kept_shards_are_not_read(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    files, same = _steps(tmp_path / "a", 0)
    assert same and files[0] >= 4 * round_up(2 * 2048)  # units 1 and 2, each twice
    kept, same = _steps(tmp_path / "b", 2 * 2048)  # room for one of the two
    assert same
    # unit 2, the last file of forward, is the first of backward: kept (one read less);
    # unit 1, the last of backward, stays kept into the next forward (from step 2 on)
    one = round_up(2 * 2048)
    # (at least: the store's prefetch of the unit that came next last time also reads less)
    assert all(f - k >= want for f, k, want in zip(files, kept, [one, 2 * one, 2 * one])), (files, kept)


# -- end to end: a tiny GPT, everything on NVMe, world 1 ------------------------------------------
def _zero(path, param=None, opt=None):
    zero = {**offload("nvme", str(path), buffer_count=8, **({"max_in_cpu": opt} if opt is not None else {})),
            "sub_group_size": 3000,
            "offload_param": {"device": "nvme", "nvme_path": str(path),
                              **({"max_in_cpu": param} if param is not None else {})}}
    return zero


def _run(s, keep_units):
    """Losses, final parameters and the last step's bytes; `keep_units`: then keep that many
    of the units' shards from forward to backward (the store's keep cache)."""
    engine = _engine(s)
    store = engine.strategy.units[0].shard_store
    sizes = [round_up(n * 2) for n in store.numel]
    if keep_units:  # room for k block units (the embedding's and head's, larger, are not kept)
        store.keep(keep_units * max(n for n in sizes if n < max(sizes)))
    losses, moved = train_counting_last_step(engine, s)
    opt = engine.optimizer.store
    out = {"losses": losses, "params": full_state_dict(engine), **moved, "resident": sorted(store._resident),
           "numel": list(store.numel), "sizes": sizes, "groups": opt.resident_summary(),
           "sg_numel": [sg.numel for sg in opt.sub_groups], "kept": sorted(store._kept)}
    from meshspeed.offload import close

    close(engine)
    return out


def _runs(setups, keeps):
    return [_run(s, k) for s, k in zip(setups, keeps)]


def test_residency_cuts_the_bytes_and_not_the_bits(tmp_path):
    kw = {"precision": "bf16", "steps": 3, "world": 1, "extra_config": exact_adamw()}
    dirs = [tmp_path / d for d in "abc"]
    for d in dirs:
        d.mkdir()
    base = setup(3, _zero(dirs[0], 0, 0), **kw)
    budget = setup(3, _zero(dirs[1], 6000, 6000), **kw)
    keep = setup(3, _zero(dirs[2], 0, 0), **kw)
    zero, res, kept = run_distributed(_runs, world_size=1, args=([base, budget, keep], [0, 0, 2]),
                                      timeout=300)[0]
    assert zero["resident"] == [] and zero["groups"] == (0, 0)
    assert res["resident"], "the budget was meant to cover at least one unit"
    assert res["groups"][0] >= 1, "and at least one optimizer sub-group"
    for other in (res, kept):
        assert other["losses"] == zero["losses"]
        assert all(torch.equal(other["params"][k], v) for k, v in zero["params"].items())
    # a resident unit's shard is read neither for forward nor for backward, and not written
    shard = sum(res["sizes"][i] for i in res["resident"])
    written = sum(2 * res["numel"][i] for i in res["resident"])
    # a resident sub-group's master and moments are neither read nor written (its gradient is)
    # (the two moments' files are read and written whole, 4 KiB-aligned; the masters' runs exactly)
    groups = sum(2 * round_up(4 * n) + 4 * n for n in res["sg_numel"][: res["groups"][0]])
    # (the budget-0 run may also read one resident unit a third time: the store's read of
    # "the unit that came next last time" guesses wrong once the step's publish drops it;
    # Note [resident shards and shards kept from forward to backward])
    extra = zero["read"] - res["read"] - (2 * shard + groups)
    assert extra == 0 or extra in [res["sizes"][i] for i in res["resident"]], (zero, res)
    assert zero["write"] - res["write"] == written + groups, (zero, res)
    # a kept shard is not read in backward (and the units backward fetched last are still
    # kept at the next forward); the store's prefetch of "the unit that came next last
    # time" shifts a read or two, so the figure is a bound, not exact
    assert len(kept["kept"]) == 2 and zero["write"] == kept["write"], kept["numel"]
    two = sum(kept["sizes"][i] for i in kept["kept"])
    assert two <= zero["read"] - kept["read"] <= 2 * two + max(kept["sizes"]), (zero, kept)


def test_estimate_counts_the_resident_bytes_in_host_memory():
    from meshspeed.planner.estimate import estimate_memory

    kw = {"stage": 3, "dp": 1, "offload_optimizer": "nvme", "offload_param": "nvme"}
    base = estimate_memory(2e9, **kw)
    kept = estimate_memory(2e9, **kw, param_in_cpu=5 * 10**8, optimizer_in_cpu=10**8)
    assert kept["tiers"]["host"] - base["tiers"]["host"] == 5 * 10**8 * 2 + 10**8 * OPTIMIZER_BYTES
    assert "resident_state" not in base["detail"]["offload_buffers"]  # unchanged when unset


def _save_then_load(saver, loader, save_dir):
    """Train 3 steps under `saver`, save, train the rest; an engine under `loader` loads
    and trains the same batches: their losses."""
    engine = _engine(saver)
    batches = make_batches(saver)
    _train_batches(engine, saver, batches[:3])
    engine.save_checkpoint(save_dir, tag="t")
    tail = _train_batches(engine, saver, batches[3:])
    from meshspeed.offload import close

    close(engine)
    fresh = _engine(loader)
    fresh.load_checkpoint(save_dir, tag="t")
    again = _train_batches(fresh, loader, batches[3:])
    close(fresh)
    return tail, again


def _both_ways(resident, files, root):
    return [_save_then_load(resident, files, f"{root}/a"), _save_then_load(files, resident, f"{root}/b")]


def test_checkpoints_move_between_resident_state_and_files(tmp_path):
    """Resident masters and moments are saved from memory and loaded into memory: a
    checkpoint of a run with residency continues bit-identically in a run without, and back."""
    kw = {"precision": "bf16", "steps": 4, "world": 1, "extra_config": exact_adamw()}
    (tmp_path / "r").mkdir()
    (tmp_path / "f").mkdir()
    resident = setup(3, _zero(tmp_path / "r", 6000, 6000), **kw)
    files = setup(3, _zero(tmp_path / "f", 0, 0), **kw)
    out = run_distributed(_both_ways, world_size=1, args=(resident, files, str(tmp_path)), timeout=300)[0]
    for tail, again in out:
        assert tail == again


def _stage2(setups):
    from meshspeed.offload import close

    out = []
    for s in setups:
        engine = _engine(s)
        losses = _train_batches(engine, s, make_batches(s))
        out.append((losses, full_state_dict(engine), engine.optimizer.store.resident_summary()[0]))
        close(engine)
    return out


def test_stage2_optimizer_residency_is_bit_identical(tmp_path):
    """Below stage 3 there is no shard store: the budget goes to optimizer sub-groups only."""
    kw = {"precision": "bf16", "steps": 3, "world": 1, "extra_config": exact_adamw()}
    runs = [setup(2, {**offload("nvme", str(tmp_path), buffer_count=8, max_in_cpu=n), "sub_group_size": 3000},
                  **kw) for n in (0, 9000, 10**9)]  # none, some, all (then the pool is 2 buffers)
    files, *resident = run_distributed(_stage2, world_size=1, args=(runs,), timeout=300)[0]
    assert files[2] == 0 and 1 <= resident[0][2] < resident[1][2], (files[2], resident[0][2], resident[1][2])
    for r in resident:
        assert files[0] == r[0]  # losses
        assert all(torch.equal(files[1][k], v) for k, v in r[1].items())
