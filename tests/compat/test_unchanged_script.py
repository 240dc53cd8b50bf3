"""End to end: a script that does `import deepspeed` runs, unchanged, under
`meshspeed run --deepspeed-compat --num_gpus 2` (two CPU processes on gloo), as the
tutorials run it with `deepspeed --num_gpus 2 train.py --deepspeed --deepspeed_config ...`."""

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("ds_unchanged_train.py")
ROOT = Path(__file__).resolve().parents[2]


def test_unchanged_deepspeed_script_trains_and_converts(tmp_path):
    config = {
        "train_batch_size": 16,  # 8 per rank x 2 ranks
        "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": 2},
        "steps_per_print": 1000,
    }
    cfg = tmp_path / "ds_config.json"
    cfg.write_text(json.dumps(config))
    # PYTHONPATH: this checkout's meshspeed in the launched processes (the script's own
    # directory is sys.path[0] there, not the working directory)
    env = {"OMP_NUM_THREADS": "1", "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
           "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "meshspeed.cli", "run", "--deepspeed-compat", "--num_gpus", "2",
         str(SCRIPT), "--deepspeed", "--deepspeed_config", str(cfg), "--save_dir", str(tmp_path / "ckpt")],
        capture_output=True, text=True, timeout=300, check=False, env=env, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "COMPAT steps 24 " in proc.stdout, proc.stdout[-3000:]
    assert "COMPAT_OK" in proc.stdout, proc.stdout[-3000:]
