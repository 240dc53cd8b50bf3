"""The SIGTERM report (Note [naming the dead rank when torchrun stops the job]); under
torchrun it is exercised by test_auto_resume.py, where rank 0 names the killed rank."""

from __future__ import annotations

import json
import os
import signal
import socket
import time

from meshspeed.process import stopped
from meshspeed.testing.harness import run_distributed


def test_installed_only_under_torchelastic():
    before = signal.getsignal(signal.SIGTERM)
    assert stopped.install_stop_report(environ={}) is False
    assert signal.getsignal(signal.SIGTERM) == before


def test_message_without_a_dead_peer_says_so():
    msg = stopped.stop_message(0, 2, "train.py:12 in main")
    assert msg.startswith("meshspeed: rank 0 stopped by the launcher (SIGTERM) at train.py:12 in main: ")
    assert "no rank has died that this host can see" in msg


def test_where_names_the_script_line_and_the_meshspeed_one():
    import sys

    here = stopped._where(sys._getframe())
    assert "test_stopped.py:" in here and "test_where_names" in here


def _remote_report(case: str) -> str:
    """Rank 0 of 2 reads the report for a job of 4 whose ranks 2 and 3 are on host "node1"
    (records made up here, in this test's own attempt)."""
    # lazy: only the ranks need the registry
    from torch.distributed import distributed_c10d

    from meshspeed.comm import registry, rollcall

    os.environ[registry.ROUND_VAR] = {"dead": "9001", "stale": "9002", "joined": "9003", "back": "9004",
                                      "stopped": "9005"}[case]
    os.environ["LOCAL_WORLD_SIZE"] = "4" if case == "stopped" else "2"
    os.environ["LOCAL_RANK"] = os.environ["RANK"]
    try:
        store = registry.root_store()
        fresh, old = time.time(), time.time() - 60
        if int(os.environ["RANK"]) == 1:
            for rank, pid in ((2, 812), (3, 813)):
                beat = old if case == "stale" else fresh + 3600  # fresh for the whole test
                store.set(f"{registry.PREFIX}/{rank}", json.dumps(
                    {"host": "node1", "pid": pid, "attempt": registry.attempt(), "t": beat}))
            if case == "dead":
                registry.post_dead(store, 3, 813)
            if case == "joined":
                store.set(registry.joining_key(registry.attempt()), json.dumps(["node2"]))
            if case == "stopped":  # ranks 2 and 3 on this host, gone; 2 was stopped by SIGTERM
                for rank in (2, 3):  # where init_distributed posts them (Note [roll call])
                    distributed_c10d._get_default_store().set(rollcall._key("who", rank), json.dumps(
                        {"host": socket.gethostname(), "pid": _gone_pid()}))
                registry.post_stopped(store, 2)
            if case == "back":
                store.set(registry.returned_key(registry.attempt()), json.dumps(["node1"]))
        store.set(f"ready/{case}/{os.environ['RANK']}", "1")
        store.wait([f"ready/{case}/0", f"ready/{case}/1"])
        if int(os.environ["RANK"]) != 0:
            return ""
        return stopped.stop_message(0, 4, "train.py:12 in main", wait_s=1.0)
    finally:
        del os.environ[registry.ROUND_VAR]


def test_a_rank_another_host_posted_dead_is_named_with_its_host():
    msg = run_distributed(_remote_report, 2, args=("dead",))[0]
    assert ": rank 3 on host node1 (process 813): died (see its own output" in msg, msg


def test_a_rank_whose_heartbeat_stopped_is_named_unreachable():
    msg = run_distributed(_remote_report, 2, args=("stale",))[0]
    assert "rank 2 on host node1 (process 812): unreachable since " in msg, msg
    assert "rank 3 on host node1 (process 813): unreachable since " in msg, msg


def test_a_host_joining_is_reported_as_a_join_not_a_death():
    msg = run_distributed(_remote_report, 2, args=("joined",))[0]
    assert ": host node2 joined; the job restarts at the new size; it resumes" in msg, msg
    assert "died" not in msg, msg


def test_the_ranks_of_a_host_whose_agent_came_back_died():
    msg = run_distributed(_remote_report, 2, args=("back",))[0]
    assert ("rank 2 on host node1 (process 812): died (host node1 came back without it), "
            "rank 3 on host node1 (process 813): died") in msg, msg


def _gone_pid() -> int:
    """A process id that is not in use (a child that has exited and been reaped)."""
    # lazy: only the test's rank needs it
    import subprocess

    child = subprocess.Popen(["true"])
    child.wait(timeout=30)
    return child.pid


def test_a_sibling_the_launcher_stopped_is_not_reported_dead():
    msg = run_distributed(_remote_report, 2, args=("stopped",))[0]
    assert "rank 3 on host" in msg and "(process " in msg and "): died" in msg, msg
    assert "rank 2 on host" not in msg, msg
