"""DeepSpeed pipeline checkpoints (PipelineModule: layer_<LL>-model_states.pt plus each
stage's mp_rank_<SS>_model_states.pt and, at ZeRO 1, its optimizer file) loaded by meshspeed.

The fixtures fixtures/deepspeed/pipe_pp2_z{0,1}/ were saved by DeepSpeed 0.19.8 at pp 2,
dp 1, fp32 (benchmarks/ds_checkpoint_pptp.py --write-fixtures; the folder's README.md);
their expected.json holds the losses DeepSpeed trains after loading them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from meshspeed.checkpoint import CheckpointError, convert
from meshspeed.checkpoint.deepspeed_format.discover import find_tag
from meshspeed.checkpoint.deepspeed_format.kinds import open_tag
from meshspeed.checkpoint.deepspeed_format.unpickle import load_torch_file
from meshspeed.testing.harness import run_distributed
from tests.checkpoint import ds_pptp_workers

FIXTURES = Path(__file__).parent / "fixtures" / "deepspeed"
NAMES = ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]


def _fixture(stage: int) -> tuple[Path, dict]:
    root = FIXTURES / f"pipe_pp2_z{stage}"
    return root / "ckpt", json.loads((root / "expected.json").read_text())


def _clip(stage: int) -> float:
    return 0.0 if stage == 0 else 1.0  # Note [the pipeline without ZeRO is not clipped here] (benchmark)


@pytest.mark.parametrize("stage", [0, 1])
def test_reads_every_stage_under_its_layer_names(stage):
    ckpt, _ = _fixture(stage)
    ds = open_tag(find_tag(str(ckpt), None))
    tag = ckpt / "global_step2"
    got = {p.name: p for p in ds.params()}
    assert list(got) == NAMES
    for name, p in got.items():
        layer, key = name.split(".")
        assert torch.equal(p.master, load_torch_file(str(tag / f"layer_0{layer}-model_states.pt"))[key])
        assert p.step == 2 and set(p.moments) == {"exp_avg", "exp_avg_sq"}
        assert p.moments["exp_avg"].shape == p.master.shape and p.moments["exp_avg_sq"].abs().sum() > 0
    # stage 1's Adam state is the second stage's optimizer file's (not a copy of stage 0's)
    if stage == 0:
        opt = load_torch_file(str(tag / "mp_rank_01_model_states.pt"))["optimizer"]["state"]
        assert torch.equal(got["4.weight"].moments["exp_avg"], opt[0]["exp_avg"])
    assert ds.counters["global_steps"] == 2 and ds.client_state == {"epoch": 3}


@pytest.mark.parametrize("stage", [0, 1])
def test_pp2_checkpoint_trains_on_as_deepspeed_at_pp2_pp1_and_without_a_pipeline(stage):
    ckpt, info = _fixture(stage)
    want = info["ds_losses_after_load"]
    for world, target in [(2, "pipe"), (1, "pipe"), (2, "plain")]:
        out = run_distributed(ds_pptp_workers.load_and_train, world, args=(str(ckpt), target, stage, _clip(stage)))
        for r in out:
            assert r["losses"] == pytest.approx(want, rel=1e-5), (world, target)
            assert (r["global_steps"], r["client"], r["sched"]) == (2, {"epoch": 3}, 1)


def test_convert_writes_the_layer_weights(tmp_path):
    ckpt, _ = _fixture(1)
    out = tmp_path / "model.safetensors"
    convert(str(ckpt), str(out))
    got = load_file(str(out))
    assert sorted(got) == sorted(NAMES)
    assert torch.equal(got["2.weight"], load_torch_file(str(ckpt / "global_step2" / "layer_02-model_states.pt"))["weight"])


def test_a_missing_layer_file_is_named(tmp_path):
    ckpt, _ = _fixture(1)
    shutil.copytree(ckpt, tmp_path / "ds")
    (tmp_path / "ds" / "global_step2" / "layer_04-model_states.pt").unlink()
    with pytest.raises(CheckpointError, match=r"'4\.weight', which no layer file"):
        open_tag(find_tag(str(tmp_path / "ds"), None))


def test_a_missing_stage_file_is_named(tmp_path):
    ckpt, _ = _fixture(0)
    shutil.copytree(ckpt, tmp_path / "ds")
    (tmp_path / "ds" / "global_step2" / "mp_rank_01_model_states.pt").unlink()
    with pytest.raises(CheckpointError, match=r"stages \[0\] but was saved with 2 pipeline stages"):
        open_tag(find_tag(str(tmp_path / "ds"), None))
