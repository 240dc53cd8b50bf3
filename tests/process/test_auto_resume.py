"""Automatic resume after a failure (issue 17): a rank killed mid-training under
`meshspeed run --max-restarts 1` is named by rank 0, the job restarts, resumes from its
newest complete checkpoint by itself (`checkpoint.auto_resume`), reads the same batches,
and ends with the parameters of an uninterrupted run, bit for bit."""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
from pathlib import Path

import torch

from meshspeed.testing.harness import run_distributed
from tests.process import restart_script

ROOT = Path(__file__).resolve().parents[2]


def _launch(out_dir: Path, kill_at: int) -> subprocess.CompletedProcess:
    """The job, bounded by 240 s, less than the script's 300 s comms_timeout: a survivor
    left waiting for the dead rank (instead of being stopped) fails the test by timing out."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "OMP_NUM_THREADS": "1",
           "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "meshspeed.cli", "run", "--nproc-per-node", "2", "--max-restarts", "1",
         str(Path(restart_script.__file__)), str(out_dir), str(kill_at)],
        check=False, capture_output=True, text=True, timeout=240, env=env, cwd=out_dir)


def _steps(log: Path) -> dict[int, list[tuple[int, float]]]:
    """attempt -> [(step, loss)] in order."""
    out: dict[int, list[tuple[int, float]]] = {}
    for line in log.read_text().splitlines():
        attempt, step, loss = re.fullmatch(r"attempt (\d+) step (\d+) loss (\S+)", line).groups()
        out.setdefault(int(attempt), []).append((int(step), float(loss)))
    return out


def test_a_killed_rank_restarts_and_the_job_ends_as_if_never_interrupted(tmp_path):
    total, every = restart_script.TOTAL, restart_script.EVERY
    # mid-step, after a checkpoint and not right at one, so some steps are done twice
    kill_at = random.Random(17).choice([s for s in range(every + 1, total) if s % every])
    killed, reference = tmp_path / "killed", tmp_path / "reference"
    killed.mkdir()
    reference.mkdir()
    proc = _launch(killed, kill_at)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert (killed / "killed").exists(), "rank 1 never killed itself: the test tested nothing"

    # rank 0 names the dead rank, whichever comes first: its collective fails and the roll
    # call finds rank 1's process gone (Note [roll call]), or torchrun stops it and the
    # SIGTERM report says so (Note [naming the dead rank when torchrun stops the job])
    # (where rank 0 was may be inside a library the script called, e.g. json's encoder)
    stopped = re.search(r"^meshspeed: rank 0 stopped by the launcher \(SIGTERM\) at \S+:\d+ "
                        r".*: rank 1 on host \S+ \(process \d+\): died", out, re.MULTILINE)
    failed = re.search(r"PeerLostError: rank 0: .*\n(.*\n)*?.*rank 1 on host \S+ \(process \d+\): died", out)
    assert stopped or failed, out[-4000:]

    # attempt 0 ran up to the killed step; attempt 1 started at the last checkpoint before it
    steps = _steps(killed / "log-rank0.txt")
    assert sorted(steps) == [0, 1], steps
    first = [s for s, _ in steps[0]]
    second = [s for s, _ in steps[1]]
    last_checkpoint = kill_at // every * every
    assert first == list(range(kill_at)), first
    assert second == list(range(last_checkpoint, total)), second
    assert 0 < kill_at - last_checkpoint < every  # lost: only the steps since that checkpoint
    # the steps done twice read the same batches and give the same losses, bit for bit
    assert steps[1][: kill_at - last_checkpoint] == steps[0][last_checkpoint:]

    run_distributed(restart_script.train, 2, args=(str(reference), -1), timeout=180)
    assert [s for s, _ in _steps(reference / "log-rank0.txt")[0]] == list(range(total))
    resumed, uninterrupted = torch.load(killed / "final.pt"), torch.load(reference / "final.pt")
    assert resumed.keys() == uninterrupted.keys()
    for name, value in uninterrupted.items():
        assert torch.equal(resumed[name], value), f"{name} differs from the uninterrupted run"
    reference_losses = _steps(reference / "log-rank0.txt")[0]
    assert steps[1] == reference_losses[last_checkpoint:]
