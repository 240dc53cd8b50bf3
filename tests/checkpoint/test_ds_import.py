"""DeepSpeed checkpoints read by meshspeed, checked against DeepSpeed 0.19.8's own numbers.

The fixtures under fixtures/deepspeed/<case>/ are real DeepSpeed checkpoints (`ckpt/`)
with what DeepSpeed held when it saved (`expected.safetensors`: fp32 masters, Adam
moments, buffers; `expected.json`: step, counters, scheduler, client state, and the
losses of the 3 steps DeepSpeed trains after loading). They were written by
benchmarks/ds_checkpoint_import.py --write-fixtures (see the folder's README.md).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from meshspeed.checkpoint import CheckpointError, consolidate, convert
from meshspeed.checkpoint.deepspeed_format.discover import find_tag
from meshspeed.checkpoint.deepspeed_format.read import read_tag
from meshspeed.testing.harness import run_distributed
from tests.checkpoint import ds_workers

FIXTURES = Path(__file__).parent / "fixtures" / "deepspeed"
CASES = ["z0_dp1_fp32", "z1_dp2_fp32", "z2_dp2_bf16", "z3_dp2_fp32", "z0_dp1_bf16"]


def _fixture(case: str) -> tuple[Path, dict, dict[str, torch.Tensor]]:
    root = FIXTURES / case
    return root / "ckpt", json.loads((root / "expected.json").read_text()), load_file(str(root / "expected.safetensors"))


@pytest.mark.parametrize("case", CASES)
def test_reads_masters_moments_and_loop_state(case):
    ckpt, info, expected = _fixture(case)
    ds = read_tag(find_tag(str(ckpt), None))
    assert (ds.stage, ds.precision) == (info["zero_stage"], info["precision"])
    seen = set()
    for p in ds.params():
        seen.add(p.name)
        assert torch.equal(p.master, expected[f"master/{p.name}"]), p.name
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(p.moments[k], expected[f"optim/{k}/{p.name}"]), (p.name, k)
        assert p.step == info["step"]
    assert seen == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    assert torch.equal(ds.buffers["shift"].float(), expected["buffer/shift"])
    assert ds.lr_scheduler == info["lr_scheduler"]
    assert ds.counters == {k: info[k] for k in ("global_steps", "global_samples", "skipped_steps")}
    client = ds.client_state
    assert (client["epoch"], client["note"], client["offsets"].tolist()) == (3, "from deepspeed", [0, 1, 2, 3])


@pytest.mark.parametrize("case", ["z1_dp2_fp32", "z3_dp2_fp32"])
def test_convert_writes_the_fp32_masters_like_zero_to_fp32(case, tmp_path):
    ckpt, _, expected = _fixture(case)
    out = tmp_path / "model.safetensors"
    summary = convert(str(ckpt), str(out))
    got = load_file(str(out))
    assert summary["tensors"] == 5 and set(got) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "shift"}
    for name, t in got.items():
        key = f"buffer/{name}" if name == "shift" else f"master/{name}"
        assert torch.equal(t, expected[key]), name
    assert torch.equal(consolidate(str(ckpt), dtype=torch.bfloat16)["fc1.weight"],
                       expected["master/fc1.weight"].bfloat16())


# (fixture, meshspeed dp, meshspeed stage): the same layout and another one
LOADS = [("z1_dp2_fp32", 2, 1), ("z3_dp2_fp32", 1, 0), ("z0_dp1_fp32", 2, 3), ("z2_dp2_bf16", 2, 2)]


@pytest.mark.parametrize("case,dp,stage", LOADS)
def test_engine_continues_with_deepspeeds_losses(case, dp, stage, tmp_path):
    ckpt, info, _ = _fixture(case)
    src = tmp_path / "ds"
    shutil.copytree(ckpt, src)
    out = run_distributed(ds_workers.load_and_train, dp, args=(str(src), stage, info["precision"]))[0]
    ref = info["ds_losses_after_load"]
    # fp32: DeepSpeed's arithmetic, in another summation order across layouts; bf16: the
    # forward runs in bf16, so a changed reduction order moves a loss by a few bf16 ulps
    tol = 1e-5 if info["precision"] == "fp32" else 2e-2
    assert max(abs(a - b) / abs(b) for a, b in zip(out["losses"], ref)) < tol, (out["losses"], ref)
    assert out["global_steps"] == info["global_steps"] and out["global_samples"] == info["global_samples"]
    assert out["sched"] == info["lr_scheduler"]["last_batch_iteration"]
    assert out["lr"] == pytest.approx(info["lr"][0])
    assert out["client"] == {"epoch": 3, "note": "from deepspeed", "offsets": [0, 1, 2, 3]}
    assert out["path"] == str(src / "global_step2")
    assert not [p for p in src.iterdir() if p.name.startswith(".meshspeed-import-")]  # removed


def test_a_missing_optimizer_states_file_is_named(tmp_path):
    ckpt, _, _ = _fixture("z1_dp2_fp32")
    shutil.copytree(ckpt, tmp_path / "ds")
    (tmp_path / "ds" / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(CheckpointError, match="zero_pp_rank_1_mp_rank_00_optim_states.pt"):
        read_tag(find_tag(str(tmp_path / "ds"), None))


def test_a_meshspeed_directory_is_not_taken_for_deepspeed(tmp_path):
    (tmp_path / "global_step1").mkdir()
    (tmp_path / "global_step1" / "meta.json").write_text("{}")
    (tmp_path / "latest").write_text("global_step1")
    assert find_tag(str(tmp_path), None) is None
