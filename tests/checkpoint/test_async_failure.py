"""Success means success: a failed final asynchronous save makes the process exit
non-zero, and engine.destroy() raises it (issue 9 case 4)."""

import glob
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("async_fail_script.py")


@pytest.mark.parametrize("mode, code", [("exit", 1), ("destroy", 7)])
def test_failed_final_async_save_is_not_success(tmp_path, mode, code):
    proc = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "ckpt"), mode], check=False,
                          capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1",
                               "PYTHONPATH": str(Path(__file__).parents[2])})
    out = proc.stdout + proc.stderr
    assert proc.returncode == code, out[-2000:]
    assert "no space left on device" in out
    assert "rank-00000.safetensors" in out, out[-2000:]  # the file is named
    assert not glob.glob(str(tmp_path / "ckpt" / "*.tmp-*")), "the failed save left its temp folder"
    if mode == "exit":
        assert "training finished" in out and "asynchronous checkpoint save" in out
    else:
        assert "destroy raised CheckpointError" in out
