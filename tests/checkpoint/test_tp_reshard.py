"""Tensor-parallel checkpoints: saved at one tp x dp x ZeRO stage, loaded at another.

World sizes 1, 2 and 4 on gloo. `tp_workers.TinyTP` splits its parameters by hand (column,
row = dim 1, fused q|k|v, a padded 13-row vocabulary, replicated ones) and announces the
pieces in `tp_shards`; engines are composed over the topology's dp group with
`engine.topology` attached (tp_workers.tp_engine). Every loaded rank's master range and
Adam moments must equal the tp=1 reference cut the same way, and one more step after the
load must match the reference's next step. `meshspeed convert`, `consolidate`,
`zero_to_fp32` and `save_16bit_model` of a tp checkpoint give the logical tensors.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from meshspeed import cli
from meshspeed.checkpoint import consolidate
from meshspeed.testing.harness import run_distributed
from meshspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from tests.checkpoint import tp_workers

N = 2  # steps before the save; one more after the load
EXPORTED = ("tp2dp2s1", "tp2dp1s3")  # also save_16bit_model (ZeRO-1 and ZeRO-3)
# name -> (world, tp, stage) of the save
SAVES = {"tp2dp2s1": (4, 2, 1), "tp4dp1s0": (4, 4, 0), "tp1dp2s2": (2, 1, 2), "tp2dp1s3": (2, 2, 3)}
# (save, world, tp, stage) of the load
LOADS = [("tp2dp2s1", 1, 1, 0), ("tp2dp2s1", 2, 2, 3), ("tp4dp1s0", 2, 2, 2),
         ("tp1dp2s2", 4, 2, 3), ("tp2dp1s3", 4, 4, 1)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    dirs = {name: str(root / name) for name in SAVES}
    for world in (4, 2):  # fewest pool switches: saves by world size, then loads
        for name, (w, tp, stage) in SAVES.items():
            if w == world:
                export = str(root / f"{name}-16bit") if name in EXPORTED else None
                run_distributed(tp_workers.save, w, args=(dirs[name], tp, stage, N, export))
    out = {"root": root, "dirs": dirs}
    out["ref"] = run_distributed(tp_workers.reference, 1, args=([N, N + 1],))[0]
    for world in (1, 2, 4):
        for name, w, tp, stage in LOADS:
            if w == world:
                attach = tp > 1
                out[(name, w, tp, stage)] = run_distributed(
                    tp_workers.load, w, args=(dirs[name], tp, stage, 1, attach))
    return out


def _expected(ref_row: dict, key: str, row: dict) -> torch.Tensor:
    shard = row["tp"]
    full = ref_row[key].view(tp_workers.PARAMS[row["name"]][0])
    local = shard.local_from_logical(full) if shard is not None else full
    return local.reshape(-1)[row["start"] : row["end"]]


def _check(ranks: list[list[dict]], ref: dict) -> None:
    seen = set()
    for rows in ranks:
        for row in rows:
            seen.add(row["name"])
            for key in ("master", "exp_avg", "exp_avg_sq"):
                want = _expected(ref[row["name"]], key, row)
                assert torch.allclose(row[key], want, rtol=1e-6, atol=1e-7), (row["name"], key)
    assert seen == set(tp_workers.PARAMS)


@pytest.mark.parametrize("case", LOADS, ids=[f"{n}-to-tp{tp}dp{w // tp}s{s}" for n, w, tp, s in LOADS])
def test_loads_at_another_tp_dp_and_stage(runs, case):
    results = runs[case]
    _check([r["loaded"] for r in results], runs["ref"][N])  # optimizer state preserved
    _check([r["after"] for r in results], runs["ref"][N + 1])  # and training goes on alike
    assert all(r["steps"] == N + 1 for r in results)


def test_padding_is_zero_after_loading_at_tp4(runs):
    rows = [row for r in runs[("tp2dp1s3", 4, 4, 1)] for row in r["loaded"]]
    emb = [row for row in rows if row["name"] == "emb.weight" and row["tp"].tp_rank == 3]
    assert emb and all(row["master"][4 - row["start"]:].abs().sum() == 0 for row in emb
                       if row["start"] <= 4)


def test_meta_records_logical_shapes_and_shards(runs):
    meta = json.loads((Path(runs["dirs"]["tp2dp2s1"]) / "global_step2" / "meta.json").read_text())
    assert meta["layout"]["tp_size"] == 2 and meta["layout"]["dp_size"] == 2
    for name, (shape, dim, _) in tp_workers.PARAMS.items():
        p = meta["params"][name]
        assert p["shape"] == list(shape)
        if dim is None:  # replicated over tp: written by tp rank 0 only (global ranks 0, 2)
            assert all("tp" not in r and r["rank"] % 2 == 0 for r in p["ranges"])
        else:
            assert {r["tp"]["tp_rank"] for r in p["ranges"]} == {0, 1}
            assert all(r["tp"]["logical_shape"] == list(shape) for r in p["ranges"])
    saved = json.loads((Path(runs["dirs"]["tp1dp2s2"]) / "global_step2" / "meta.json").read_text())
    assert saved["layout"]["tp_size"] == 1
    assert all("tp" not in r for p in saved["params"].values() for r in p["ranges"])


@pytest.mark.parametrize("name", ["tp2dp2s1", "tp4dp1s0"])
def test_consolidate_convert_and_zero_to_fp32_give_logical_tensors(runs, tmp_path, name):
    ref = runs["ref"][N]
    expected = {k: ref[k]["master"].view(shape) for k, (shape, _, _) in tp_workers.PARAMS.items()}
    full = consolidate(runs["dirs"][name])
    assert full.keys() == expected.keys()
    assert all(torch.equal(full[k], expected[k]) for k in expected)
    target = tmp_path / "model.safetensors"
    assert cli.main(["convert", runs["dirs"][name], str(target)]) == 0
    written = load_file(str(target))
    assert all(torch.equal(written[k], expected[k]) for k in expected)
    z = get_fp32_state_dict_from_zero_checkpoint(runs["dirs"][name])
    assert all(torch.equal(z[k], expected[k]) for k in expected)


@pytest.mark.parametrize("name", EXPORTED)
def test_save_16bit_model_writes_logical_tensors(runs, name):
    saved = load_file(str(runs["root"] / f"{name}-16bit" / "model.safetensors"))
    ref = runs["ref"][N]
    assert saved.keys() == set(tp_workers.PARAMS)
    for k, (shape, _, _) in tp_workers.PARAMS.items():
        assert torch.equal(saved[k], ref[k]["master"].view(shape)), k


def test_shards_without_a_matching_topology_fail_on_every_rank(tmp_path):
    errors = run_distributed(tp_workers.save_without_topology, 2, args=(str(tmp_path / "x"),))
    assert errors[0] == errors[1] and errors[0] is not None and "\n" not in errors[0]
    assert "'col.weight' is tp rank 0's piece of 2" in errors[0] and "engine.topology" in errors[0]
