"""A rank killed (SIGKILL) in the middle of a save: `latest` still names the previous
checkpoint, which loads; the interrupted one never appears under its tag."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from meshspeed.checkpoint import consolidate
from meshspeed.checkpoint.paths import read_latest
from meshspeed.testing.harness import run_distributed
from tests.checkpoint import workers

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("crash_script.py")


def _wait_for(paths: list[Path], proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        if proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            raise AssertionError(f"training exited ({proc.returncode}) before freezing:\n{out[-4000:]}")
        if time.monotonic() > deadline:
            raise AssertionError("ranks never reached the pause inside the second save")
        time.sleep(0.05)


def _load_first(save_dir: str) -> int:
    setup = workers.setup_for(2, 1, steps=2)
    engine = workers.make_engine(setup, seed=3)
    path, _ = engine.load_checkpoint(save_dir)
    assert path.endswith("first")
    return engine.global_steps


def test_sigkill_mid_save_keeps_previous_checkpoint(tmp_path):
    save_dir, flags = tmp_path / "ckpt", tmp_path / "flags"
    flags.mkdir()
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(SCRIPT), str(save_dir), str(flags), "3"]
    proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        _wait_for([flags / "rank0.pid", flags / "rank1.pid"], proc, timeout=120)
        os.kill(int((flags / "rank1.pid").read_text()), signal.SIGKILL)  # rank 1 dies mid-save
        try:
            proc.wait(timeout=60)  # torchrun notices and stops rank 0
        except subprocess.TimeoutExpired:
            pass
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        # rank 0 is held in a sleep; make sure nothing outlives the test
        for pid_file in flags.glob("rank*.pid"):
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert proc.returncode != 0
    assert read_latest(str(save_dir)) == "first"
    assert not (save_dir / "second").exists()
    assert glob.glob(str(save_dir / "second.tmp-*")), "the interrupted save left no trace at all?"
    state = consolidate(save_dir)  # verifies every file's SHA-256 too
    assert state and all(t.isfinite().all() for t in state.values())
    assert run_distributed(_load_first, 2, args=(str(save_dir),)) == [1, 1]
