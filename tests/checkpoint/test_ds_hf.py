"""Hugging Face Trainer checkpoints moved between DeepSpeed and meshspeed, without DeepSpeed.

The fixtures under fixtures/deepspeed/hf_<case>/ are `checkpoint-3` folders the Trainer
wrote while running on DeepSpeed 0.19.8 (benchmarks/ds_hf_checkpoint.py --write-fixtures),
with DeepSpeed's losses of steps 4-6 after `resume_from_checkpoint` on DeepSpeed. The same
unchanged Trainer script (ds_hf_trainer.py) resumes from each on meshspeed, through the
alias as `meshspeed compat install` installs it, and must give those losses. With
`"checkpoint": {"format": "deepspeed"}` in the Trainer's ds_config, the checkpoint meshspeed
then writes holds DeepSpeed's files too, and they say what meshspeed's own files say.
(That DeepSpeed itself resumes from such a folder with the same losses is measured by the
benchmark, benchmarks/results/ds_hf_checkpoint.json.)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from meshspeed.checkpoint import consolidate
from meshspeed.checkpoint.deepspeed_format.discover import scan
from meshspeed.checkpoint.deepspeed_format.read import read_tag
from meshspeed.compat.install import write_shim

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "deepspeed"
SCRIPT = Path(__file__).resolve().parent / "ds_hf_trainer.py"
RTOL = 1e-5  # fp32


def _resume(case: str, tmp_path: Path) -> tuple[dict[int, float], dict, Path]:
    """Resume the fixture's checkpoint-3 on meshspeed; the losses printed, the fixture's
    expectations and the output folder."""
    expected = json.loads((FIXTURES / case / "expected.json").read_text())
    ckpt = tmp_path / "checkpoint-3"  # a copy: loading writes a temporary directory beside the tag
    shutil.copytree(FIXTURES / case / "checkpoint-3", ckpt)
    site = tmp_path / "site"
    write_shim(str(site))
    env = {"OMP_NUM_THREADS": "1", "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path),
           "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
               str(expected["processes"]), str(SCRIPT), *expected["script_args"], "--out", "out",
               "--resume", str(ckpt)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False, env=env, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "DONE" in out, out[-4000:]
    losses = {int(line.split()[1]): float(line.split()[2]) for line in out.splitlines() if line.startswith("LOSS ")}
    return losses, expected, tmp_path / "out"


@pytest.mark.parametrize("case", ["hf_z2_dp1", "hf_z3_dp1_hfopt"])
def test_trainer_resumes_a_deepspeed_checkpoint_with_deepspeeds_losses(case, tmp_path):
    """ZeRO-2 with the ds_config's AdamW and WarmupLR; ZeRO-3 with the Trainer's own torch
    AdamW and linear schedule (its scheduler.pt). Steps 4-6 after the resume are DeepSpeed's."""
    losses, expected, out = _resume(case, tmp_path)
    want = {int(s): v for s, v in expected["losses_after_resume"].items()}
    assert sorted(losses) == [4, 5, 6]  # resumed at step 3, not a fresh start
    for step, value in want.items():
        assert abs(losses[step] - value) <= RTOL * abs(value), (step, losses[step], value)
    # and they are not what a fresh start gives: the state really came from the checkpoint
    assert abs(losses[4] - expected["losses"]["1"]) > 1e-4
    assert not any((tmp_path / "checkpoint-3").glob(".meshspeed-import-*"))  # temporary copy removed

    # The script asks for the DeepSpeed trail: checkpoint-6, written by meshspeed, holds
    # DeepSpeed's files next to meshspeed's, and both give the same fp32 masters and step.
    tag = out / "checkpoint-6" / "global_step6"
    assert (tag / "meta.json").is_file() and (out / "checkpoint-6" / "latest").read_text().strip() == "global_step6"
    ds = read_tag(scan(str(tag)))
    assert ds.stage == expected["stage"] and ds.header["global_steps"] == 6
    ours = consolidate(str(out / "checkpoint-6"))
    params = {p.name: p for p in ds.params()}
    assert sorted(params) == sorted(k for k in ours if k in params) and len(params) >= 10
    for name, p in params.items():
        torch.testing.assert_close(p.master, ours[name], rtol=0, atol=0, msg=name)
        assert p.step == 6, name
