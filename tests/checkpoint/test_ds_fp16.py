"""fp16 runs across DeepSpeed and meshspeed: the dynamic loss scaler, both ways.

fixtures/deepspeed/z2_dp1_fp16 is a real DeepSpeed 0.19.8 fp16 checkpoint (ZeRO-2, one
rank; benchmarks/ds_checkpoint_import.py --write-fixtures, DeepSpeed's CPU fp16 check
turned on there): its first step overflowed (hysteresis 2 -> 1), the second did not, so its
DynamicLossScaler reads cur_scale 2^17, cur_hysteresis 1, cur_iter 2, last_overflow_iter 0.
meshspeed must load that as scale 2^17, one overflow left before the scale drops, one
clean step counted, and continue with DeepSpeed's losses and scales; and the export of
the loaded state must give DeepSpeed's scaler record back, attribute for attribute.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from meshspeed.checkpoint.deepspeed_format import export, load_torch_file
from meshspeed.checkpoint.deepspeed_format.discover import find_tag
from meshspeed.checkpoint.deepspeed_format.read import read_tag
from meshspeed.checkpoint.deepspeed_format.to_meshspeed import scaler_state
from meshspeed.testing.harness import run_distributed
from tests.checkpoint import ds_workers

CASE = Path(__file__).parent / "fixtures" / "deepspeed" / "z2_dp1_fp16"
OPTIM = "global_step2/zero_pp_rank_0_mp_rank_00_optim_states.pt"


def test_deepspeeds_dynamic_scaler_maps_to_meshspeeds():
    info = json.loads((CASE / "expected.json").read_text())
    ds = read_tag(find_tag(str(CASE / "ckpt"), None))
    assert ds.precision == "fp16" and info["loss_scaler"]["cur_hysteresis"] == 1
    assert scaler_state(ds) == {"scale": 131072.0, "hysteresis_left": 1, "good_steps": 1, "overflows_at_min": 0}


def test_engine_continues_with_deepspeeds_losses_and_scales_then_exports_the_scaler_back(tmp_path):
    info = json.loads((CASE / "expected.json").read_text())
    src, ms = tmp_path / "ds", tmp_path / "ms"
    shutil.copytree(CASE / "ckpt", src)
    out = run_distributed(ds_workers.load_and_train, 1, args=(str(src), 2, "fp16", str(ms)))[0]
    assert out["scaler"]["scale"] == info["ds_scale_after_load"] == 131072.0
    # DeepSpeed's trajectory after the load: an overflow with one hysteresis left drops the
    # scale at once (131072 -> 65536), then two clean steps (the window of 2 not yet full)
    assert out["scales"] == info["ds_scales_after_load"] == [65536.0, 65536.0, 65536.0]
    for a, b in zip(out["losses"], info["ds_losses_after_load"]):
        assert abs(a - b) <= 1e-5 * abs(b), (out["losses"], info["ds_losses_after_load"])

    # meshspeed saved the loaded state before training on; exported, the scaler object
    # is DeepSpeed's own, attribute for attribute (the real file is the golden)
    export(str(ms), str(tmp_path / "back"))
    want = load_torch_file(str(CASE / "ckpt" / OPTIM))["optimizer_state_dict"]
    got = load_torch_file(str(tmp_path / "back" / OPTIM))["optimizer_state_dict"]
    assert got["loss_scaler"].qualname == want["loss_scaler"].qualname == "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"
    assert dict(got["loss_scaler"]) == dict(want["loss_scaler"])
    assert want["loss_scaler"]["dtype"] is torch.float16
    assert got["dynamic_loss_scale"] is want["dynamic_loss_scale"] is True
    assert sorted(got) == sorted(want)
