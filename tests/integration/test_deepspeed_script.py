"""A DeepSpeed tutorial-shaped script runs unchanged under `meshspeed run` (torchrun)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("ds_style_train.py")


@pytest.mark.parametrize("stage", [0, 3])
def test_deepspeed_script_runs_under_meshspeed_run(tmp_path, stage):
    config = {
        "train_batch_size": 32,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01, "betas": [0.9, 0.999], "eps": 1e-8,
                                                 "weight_decay": 0.0}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.01,
                                                     "warmup_num_steps": 5}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1000,
    }
    cfg = tmp_path / "ds_config.json"
    cfg.write_text(json.dumps(config))
    proc = subprocess.run(
        [sys.executable, "-m", "meshspeed.cli", "run", "--nproc-per-node", "2", str(SCRIPT),
         "--deepspeed", "--deepspeed_config", str(cfg), "--save_dir", str(tmp_path / "ckpt")],
        capture_output=True, text=True, timeout=300, check=False, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "DS_STYLE_OK" in proc.stdout, proc.stdout[-3000:]
    # 256 samples / (micro 8 x 2 ranks) = 16 micro-steps per epoch, 2 epochs, accumulation 2
    assert "steps 16 " in proc.stdout
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "global_step16"
