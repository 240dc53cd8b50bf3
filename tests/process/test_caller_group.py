"""A process group the caller made (Note [a process group the caller made] in
process/distributed.py) gets what one meshspeed makes: the config's comms timeout, the hang
report naming the collective and the missing rank, the dead rank named as dead, and a clean
teardown at exit. The script (caller_group_script.py) calls `dist.init_process_group` itself,
with and without `deepspeed.init_distributed()` after it, under plain torchrun."""

import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("caller_group_script.py")


def _torchrun(mode: str, maker: str) -> tuple[int, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port)]
    if maker == "deepspeed":  # `import deepspeed` resolves to meshspeed's alias
        launcher = [sys.executable, "-m", "meshspeed.cli", "run", "--deepspeed-compat", "--nproc-per-node", "2",
                    "--master_port", str(port)]
    proc = subprocess.run([*launcher, str(SCRIPT), mode, maker], check=False, capture_output=True, text=True,
                          timeout=120, env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.parametrize("maker", ["torch", "deepspeed"])
def test_a_late_rank_on_a_caller_group_times_out_with_a_named_report(maker):
    code, out = _torchrun("late", maker)
    assert code != 0, out[-3000:]
    assert "CommTimeoutError: rank 0: all_reduce #" in out, out[-3000:]  # 3 s, the config's comms_timeout
    assert "did not complete within the timeout" in out, out[-3000:]
    assert "ranks that have not arrived in all_reduce #" in out and ": [1]" in out, out[-3000:]
    assert re.search(r"rank 1 on host \S+ \(process \d+\): still computing", out), out[-3000:]


def test_a_dead_rank_on_a_caller_group_is_named_dead():
    code, out = _torchrun("dead", "torch")
    assert code != 0, out[-3000:]
    assert "rank 0: all_reduce #" in out, out[-3000:]
    assert re.search(r"rank 1 on host \S+ \(process \d+\): (died|exited)", out), out[-3000:]


def test_a_caller_group_is_torn_down_cleanly_at_exit():
    code, out = _torchrun("clean", "torch")
    assert code == 0, out[-3000:]
    assert "rank 0 finished training" in out and "rank 1 finished training" in out
    assert "destroy_process_group() was not called" not in out, out[-3000:]
