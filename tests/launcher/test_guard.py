"""The remote side's guard (meshspeed/launcher/guard.py), on this machine: it stops the whole
tree below it -- workers in sessions of their own included -- when its stdin closes, and
passes its command's exit status on."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from meshspeed.launcher.guard import descendants

# an "agent" that starts a "worker" in a session of its own (as torchrun does), writes the
# worker's pid, then waits; with EXIT set it exits at once, orphaning the worker
AGENT = """
import os, subprocess, sys, time
w = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
open(sys.argv[1], "w").write(str(w.pid))
if len(sys.argv) > 2:
    sys.exit(int(sys.argv[2]))
time.sleep(300)
"""


def _guard(tmp_path, *agent_args: str) -> tuple[subprocess.Popen, int]:
    pid_file = tmp_path / "worker.pid"
    guard = subprocess.Popen([sys.executable, "-m", "meshspeed.launcher.guard", "--host", "h0", "--",
                              sys.executable, "-c", AGENT, str(pid_file), *agent_args],
                             stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline and guard.poll() is None
        time.sleep(0.05)
    return guard, int(pid_file.read_text())


def _gone(pid: int, timeout: float = 20) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


def test_stdin_closing_stops_the_whole_tree(tmp_path):
    guard, worker = _guard(tmp_path)
    try:
        assert worker in descendants(guard.pid)
        guard.stdin.close()  # what ssh does when the launcher goes
        guard.wait(timeout=60)
        err = guard.stderr.read()
    finally:
        guard.kill()
    assert guard.returncode == 128 + 15
    assert "meshspeed guard on h0: the connection to the launcher closed; stopping this host's processes" in err
    assert _gone(worker)


def test_the_command_status_is_passed_on_and_orphans_are_stopped(tmp_path):
    guard, worker = _guard(tmp_path, "7")
    try:
        # stdin stays open until the guard has ended (communicate() would close it first,
        # and a guard that sees its stdin close before the command exits stops the command)
        guard.wait(timeout=60)
        guard.communicate(timeout=60)
    finally:
        guard.kill()
    assert guard.returncode == 7
    assert _gone(worker)  # re-parented to the guard (a subreaper), then killed


def test_descendants_walks_the_tree():
    assert descendants(os.getpid()) == [] or all(isinstance(p, int) for p in descendants(os.getpid()))
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        assert sleeper.pid in descendants(os.getpid())
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_dead_connection_does_not_stop_the_guard_from_stopping(tmp_path):
    """ssh killed: the guard's stderr is a broken pipe, and its message cannot be written."""
    guard, worker = _guard(tmp_path)
    try:
        guard.stderr.close()
        guard.stdin.close()
        guard.wait(timeout=60)
    finally:
        guard.kill()
    assert guard.returncode == 128 + 15
    assert _gone(worker)
