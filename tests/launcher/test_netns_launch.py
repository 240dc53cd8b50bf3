"""`meshspeed run --hostfile` on real (namespaced) hosts through the ssh launcher
(meshspeed/testing/netns.py, an sshd in every host): training equals one host, output is
prefixed by host and rank, Ctrl-C or a failing host stops every host and leaves no
process behind, and a master name one host cannot use fails in one sentence."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from meshspeed.testing import run_distributed
from meshspeed.testing.netns import Cluster, sshd_available
from meshspeed.testing.parity import engine_run
from tests.launcher.tiny_train import SETUP

ok, reason = sshd_available()
pytestmark = pytest.mark.skipif(not ok, reason=reason)

HERE = Path(__file__).parent
REPO = HERE.parent.parent


def _env() -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/root", "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def _run_argv(cluster: Cluster, *script: str) -> list[str]:
    return [sys.executable, "-m", "meshspeed.cli", "run", "--hostfile", str(cluster.hostfile(slots=2)),
            "--master_addr", "node0", *script]


def _left_behind(cluster: Cluster, timeout: float = 30) -> dict[str, list[str]]:
    """Every host's processes but its sshd listener, once none is left (or at `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:
        left = {h.name: [p for p in h.processes() if "[listener]" not in p] for h in cluster.hosts}
        if not any(left.values()) or time.monotonic() > deadline:
            return {k: v for k, v in left.items() if v}
        time.sleep(0.2)


def test_two_hosts_train_as_one_host_and_print_by_host_and_rank(tmp_path):
    with Cluster(tmp_path, hosts=2, sshd=True) as cluster:
        out = cluster.shared_path / "result.pt"
        done = cluster.hosts[0].run(_run_argv(cluster, str(HERE / "tiny_train.py"), str(out)),
                                    env=_env(), cwd=tmp_path, timeout=150)
        assert done.returncode == 0, done.stderr[-3000:]
        lines = done.stdout.splitlines()
        for prefix in ("[node0 r", "[node1 r"):  # 2 ranks x 3 steps per host
            assert sum(line.startswith(prefix) and " loss " in line for line in lines) == 6, done.stdout
        assert _left_behind(cluster) == {}
        losses, state = torch.load(out)
    ref_losses, ref_state = run_distributed(engine_run, 4, args=(SETUP,), timeout=120)[0]
    assert losses == ref_losses
    assert state.keys() == ref_state.keys()
    for name, tensor in ref_state.items():
        assert torch.equal(state[name], tensor), name


def _read_lines(proc: subprocess.Popen) -> list[str]:
    """A list that fills with `proc`'s stdout lines as they come (a reader thread)."""
    seen: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            seen.append(line.decode(errors="replace").rstrip("\n"))

    threading.Thread(target=read, daemon=True).start()
    return seen


def _wait_for(proc: subprocess.Popen, seen: list[str], wanted, timeout: float = 120) -> None:
    """Until wanted(seen), bounded by `timeout` and by `proc` ending."""
    deadline = time.monotonic() + timeout
    while not wanted(seen):
        assert time.monotonic() < deadline and proc.poll() is None, "\n".join(seen)
        time.sleep(0.1)


@pytest.mark.parametrize(("sig", "launcher"), [(signal.SIGINT, "ssh"), (signal.SIGKILL, "ssh"),
                                               (signal.SIGINT, "pdsh")])
def test_ctrl_c_or_a_killed_launcher_stops_every_host_and_leaves_no_process(tmp_path, sig, launcher):
    """SIGINT: `meshspeed run` stops the hosts itself (pdsh: through pdsh's abort). SIGKILL:
    it cannot; its ssh clients see their stdin close, and each host's guard stops that host."""
    with Cluster(tmp_path, hosts=2, sshd=True) as cluster:
        err_path = tmp_path / "stderr.txt"
        argv = _run_argv(cluster, "--launcher", launcher, str(HERE / "ranks_wait.py"))
        with open(err_path, "wb") as err_file:  # a file: nobody has to drain it while we wait
            job = cluster.hosts[0].popen(argv, env=_env(), cwd=tmp_path, stdout=subprocess.PIPE, stderr=err_file)
        try:
            seen = _read_lines(job)
            _wait_for(job, seen, lambda s: sum(" up (pid" in line for line in s) == 4)
            # Ctrl-C reaches `meshspeed run` (the ssh clients run in sessions of their own);
            # job.pid is nsenter, which would die of it itself: signal its child
            child = int(Path(f"/proc/{job.pid}/task/{job.pid}/children").read_text().split()[0])
            os.kill(child, sig)
            job.wait(timeout=60)
            err = err_path.read_text(errors="replace")
        finally:
            job.kill()
        if sig == signal.SIGINT:
            assert job.returncode == 128 + signal.SIGINT, err[-2000:]
            assert "SIGINT: stopping the job on every host" in err
        assert _left_behind(cluster) == {}


def test_a_failing_host_stops_the_others_and_is_named(tmp_path):
    with Cluster(tmp_path, hosts=2, sshd=True) as cluster:
        argv = _run_argv(cluster, str(HERE / "ranks_wait.py"), "--fail-rank", "3")
        done = cluster.hosts[0].run(argv, env=_env(), cwd=tmp_path, timeout=120)
        assert done.returncode != 0
        assert "meshspeed run: the job failed: node1 failed with exit status" in done.stderr, done.stderr[-3000:]
        # the failed host's first failing rank, once, last (launcher/failures.py)
        cause = "meshspeed run: rank 3 on node1 failed first: exited with status 3 without a Python exception"
        assert done.stderr.splitlines()[-1] == cause and done.stderr.count("failed first") == 1, done.stderr[-3000:]
        assert _left_behind(cluster) == {}


def test_a_master_one_host_cannot_use_fails_in_one_sentence(tmp_path):
    with Cluster(tmp_path, hosts=2, sshd=True) as cluster:
        h0, h1 = cluster.hosts
        text = h1.etc_hosts.read_text()
        h1.etc_hosts.write_text("".join(line + "\n" for line in text.splitlines() if not line.endswith(" node0")))
        done = h0.run(_run_argv(cluster, "never_started.py"), env=_env(), cwd=tmp_path, timeout=60)
        assert done.returncode == 2
        # the resolver's reason varies ("Name or service not known", "Temporary failure ...")
        assert re.fullmatch(r"meshspeed run: on node1, the master address 'node0' does not resolve \([^)]+\); "
                            rf"use an address every host resolves, e\.g\. --master_addr {re.escape(h0.addr)}",
                            done.stderr.strip()), done.stderr
        h1.etc_hosts.write_text(text.replace(f"{h0.addr} node0", "127.0.1.1 node0"))
        done = h0.run(_run_argv(cluster, "never_started.py"), env=_env(), cwd=tmp_path, timeout=60)
        assert done.returncode == 2
        assert done.stderr.strip() == (
            "meshspeed run: on node1, the master address 'node0' resolves to the loopback address 127.0.1.1, "
            f"which other hosts cannot reach; use an address every host resolves, e.g. --master_addr {h0.addr}")
        h1.etc_hosts.write_text(text)
        cluster.cut(h1)  # unreachable: the check says so (the hosts' ssh gives up after 5 s)
        done = h0.run(_run_argv(cluster, "never_started.py"), env=_env(), cwd=tmp_path, timeout=90)
        assert done.returncode == 2
        assert done.stderr.startswith("meshspeed run: node1 cannot be reached to check it (ssh: connect to host "
                                      "node1 port 22"), done.stderr


def test_pdsh_launcher(tmp_path):
    with Cluster(tmp_path, hosts=2, sshd=True) as cluster:
        argv = _run_argv(cluster, "--launcher", "pdsh", str(HERE / "ranks_wait.py"), "--sleep", "0")
        done = cluster.hosts[0].run(argv, env=_env(), cwd=tmp_path, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        for host in ("node0", "node1"):  # pdsh puts the host first; %h gave it to the rank prefix
            ups = [line for line in done.stdout.splitlines() if line.startswith(f"{host}: [{host} r")]
            assert len(ups) == 2 and all(" up (pid" in line for line in ups), done.stdout
        assert _left_behind(cluster) == {}
