"""Export to DeepSpeed's layout, checked without DeepSpeed: the structure against golden
files DeepSpeed 0.19.8 itself wrote for the same run, and the values against the
meshspeed checkpoint (fixtures/deepspeed/README.md says how they were made)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from meshspeed.checkpoint import CheckpointError, consolidate
from meshspeed.checkpoint.deepspeed_format import export
from meshspeed.checkpoint.deepspeed_format.layout import flat_partitions, param_partition
from meshspeed.checkpoint.metadata import read_meta
from meshspeed.checkpoint.paths import resolve
from meshspeed.checkpoint.reshard import SavedTensors
from tests.checkpoint.ds_golden import compare, describe, load

GOLDEN = Path(__file__).parent / "fixtures" / "deepspeed" / "golden"
CASES = ["zero1_dp2_fp32", "zero3_dp2_fp32", "zero0_dp1_bf16"]
# Departures from DeepSpeed's own files, on purpose (docs in /work/notes/i29_write.md):
SKIP = {
    # DeepSpeed's bf16 stage-0 wrapper takes one extra (zero-gradient) optimizer step at
    # construction; the export writes meshspeed's step so DeepSpeed continues as meshspeed does
    "zero0_dp1_bf16": ("mp_rank_00_model_states.pt.dict.optimizer.dict.optimizer_state_dict.dict.state.dict.0.dict.step",
                       # meshspeed keeps float buffers in the compute dtype; DeepSpeed leaves them fp32
                       "mp_rank_00_model_states.pt.dict.module.dict.net.scale"),
}


def _export(case: str, tmp_path: Path) -> tuple[dict, Path]:
    golden = json.loads((GOLDEN / f"{case}.json").read_text())
    c = golden["case"]
    out = tmp_path / "ds"
    summary = export(GOLDEN / f"meshspeed_{case}", out, dp=c["dp"], zero_stage=c["stage"])
    return golden, Path(summary["output"])


def _structure(path: Path) -> dict:
    files = {}
    for f in sorted(path.glob("*.pt")):
        obj = load(str(f))
        for d in (obj, obj.get("optimizer_state_dict") or {}):
            if isinstance(d, dict) and "ds_config" in d:
                d["ds_config"] = "<config>"
        files[f.name] = describe(obj)
    return files


@pytest.mark.parametrize("case", CASES)
def test_structure_matches_deepspeed(case, tmp_path):
    golden, tag_dir = _export(case, tmp_path)
    assert (tag_dir.parent / "latest").read_text() == "global_step2"
    diffs = compare({"files": golden["files"]}, {"files": _structure(tag_dir)},
                    skip=tuple(f"files.{s}" for s in SKIP.get(case, ())))
    assert diffs == []


def _source(case: str):
    path = resolve(str(GOLDEN / f"meshspeed_{case}"), None)
    return SavedTensors(path, read_meta(path))


def _optim(store, name: str, state: str) -> torch.Tensor:
    n = math.prod(store.meta["params"][name]["shape"])
    out = torch.empty(n)
    store.fill(name, f"optim/{state}", 0, n, out)
    return out


def test_zero1_values_round_trip(tmp_path):
    _, tag_dir = _export("zero1_dp2_fp32", tmp_path)
    store = _source("zero1_dp2_fp32")
    masters = consolidate(str(GOLDEN / "meshspeed_zero1_dp2_fp32"))
    names = store.meta["optimizer"]["param_groups"][0]["params"]
    parts = flat_partitions([(n, masters[n].numel()) for n in names], 2)
    flat = {"master": [], "exp_avg": [], "exp_avg_sq": []}
    for r in range(2):
        sd = load(str(tag_dir / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"))["optimizer_state_dict"]
        flat["master"].append(sd["single_partition_of_fp32_groups"][0])
        for s in ("exp_avg", "exp_avg_sq"):
            flat[s].append(sd["base_optimizer_state"]["state"][0][s][: parts[r].numel - parts[r].padding])
        assert sd["base_optimizer_state"]["state"][0]["step"] == 2
    cat = {k: torch.cat(v) for k, v in flat.items()}
    pos = 0
    for n in names:
        k = masters[n].numel()
        assert torch.equal(cat["master"][pos : pos + k], masters[n].reshape(-1))
        for s in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(cat[s][pos : pos + k], _optim(store, n, s))
        pos += k
    module = load(str(tag_dir / "mp_rank_00_model_states.pt"))["module"]
    assert all(torch.equal(module[n], masters[n]) for n in masters)


def test_zero3_values_round_trip(tmp_path):
    _, tag_dir = _export("zero3_dp2_fp32", tmp_path)
    store = _source("zero3_dp2_fp32")
    masters = consolidate(str(GOLDEN / "meshspeed_zero3_dp2_fp32"))
    names = store.meta["optimizer"]["param_groups"][0]["params"]
    params = [(n, masters[n].numel()) for n in names]
    got = {n: {"master": torch.zeros(k), "exp_avg": torch.zeros(k)} for n, k in params}
    for r in range(2):
        sd = load(str(tag_dir / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"))["optimizer_state_dict"]
        part = param_partition(params, 2, r)
        flat, avg = sd["fp32_flat_groups"][0], sd["optimizer_state_dict"]["state"][0]["exp_avg"]
        assert flat.numel() == part.numel
        for p in part.pieces:
            got[p.name]["master"][p.start : p.end] = flat[p.offset : p.offset + p.numel]
            got[p.name]["exp_avg"][p.start : p.end] = avg[p.offset : p.offset + p.numel]
        model = load(str(tag_dir / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"))
        assert model["module"]["net.0.weight"].numel() == 0 and torch.equal(model["module"]["net.scale"], torch.ones(3))
    for n, _ in params:
        assert torch.equal(got[n]["master"], masters[n].reshape(-1))
        assert torch.equal(got[n]["exp_avg"], _optim(store, n, "exp_avg"))


def test_retarget_dp_and_stage(tmp_path):
    """A dp-2 ZeRO-1 checkpoint exported for dp 3 ZeRO 2: three files whose masters, padding
    stripped, are the model's flat parameters."""
    summary = export(GOLDEN / "meshspeed_zero1_dp2_fp32", tmp_path / "o", dp=3, zero_stage=2)
    masters = consolidate(str(GOLDEN / "meshspeed_zero1_dp2_fp32"))
    sds = [load(os.path.join(summary["output"], f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"))
           ["optimizer_state_dict"] for r in range(3)]
    assert [describe(sd["zero_stage"])["value"] for sd in sds] == [[2]] * 3
    assert [sd["partition_count"] for sd in sds] == [[3]] * 3
    flat = torch.cat([sd["single_partition_of_fp32_groups"][0] for sd in sds])
    names = ["net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"]
    assert torch.equal(flat, torch.cat([masters[n].reshape(-1) for n in names]))
    assert load(os.path.join(summary["output"], "mp_rank_00_model_states.pt"))["dp_world_size"] == 3


def test_files_name_only_deepspeed_and_torch_globals(tmp_path):
    """DeepSpeed's torch.load needs no meshspeed: the pickles import only torch, collections
    and builtins, and DeepSpeed's own record classes."""
    import pickletools
    import zipfile

    from tests.checkpoint.ds_golden import ALLOWED_DS

    _, tag_dir = _export("zero1_dp2_fp32", tmp_path)
    seen = set()
    for f in tag_dir.glob("*.pt"):
        with zipfile.ZipFile(f) as z:
            pkl = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
        for op, arg, _ in pickletools.genops(pkl):
            if op.name == "GLOBAL":
                seen.add(tuple(arg.split(" ", 1)))
    ds = {g for g in seen if g[0].startswith("deepspeed")}
    assert ds == ALLOWED_DS
    assert all(m.split(".")[0] in ("torch", "collections", "builtins") for m, _ in seen - ds), seen


def test_bad_target_and_existing_output(tmp_path):
    with pytest.raises(CheckpointError, match="stage"):
        export(GOLDEN / "meshspeed_zero1_dp2_fp32", tmp_path / "o", zero_stage=4)
    with pytest.raises(CheckpointError, match="does not exist"):
        export(tmp_path / "nothing", tmp_path / "o")
    assert not (tmp_path / "o" / "latest").exists()


def test_cli_to_deepspeed_and_safetensors_unchanged(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    src = str(GOLDEN / "meshspeed_zero1_dp2_fp32")
    code = "import sys; from meshspeed.cli import main; sys.exit(main(sys.argv[1:]))"
    r = subprocess.run([sys.executable, "-c", code, "convert", "--to", "deepspeed", src, str(tmp_path / "d"),
                        "--dp", "1", "--zero-stage", "3"], check=False, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(tmp_path / "d" / "global_step2")) == [
        "zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    r = subprocess.run([sys.executable, "-c", code, "convert", src, str(tmp_path / "m.safetensors")],
                       check=False, env=env, capture_output=True, text=True)
    assert r.returncode == 0 and (tmp_path / "m.safetensors").exists(), r.stderr
