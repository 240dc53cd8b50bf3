"""No wait is unbounded and every rank says who is missing (Note [roll call]): a peer that
left the loop early, or died, is named on the rank still waiting (issue 9 cases 2 and 8)."""

import re
import socket
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("early_exit_script.py")


def _torchrun(mode: str) -> subprocess.CompletedProcess:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
         str(port), str(SCRIPT), mode], check=False, capture_output=True, text=True, timeout=240,
        env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2])})


def test_a_rank_that_left_early_is_named_and_the_job_fails():
    proc = _torchrun("early")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "rank 0: all_reduce #" in out, out[-3000:]
    assert "ranks that have not arrived in all_reduce #" in out and ": [1]" in out, out[-3000:]
    # the rank is named with its host and process (Note [host registry and heartbeat])
    assert re.search(r"rank 1 on host \S+ \(process \d+\): exited after ", out), out[-3000:]
    assert "it left the loop early" in out, out[-3000:]
