"""Restarts and reports across hosts (issue 31), on 2 namespaced hosts x 2 ranks, each host
started by its own `meshspeed run --rdzv-backend c10d`: a host killed and started again
resumes the job exactly; a host that never returns, or whose link is cut, ends the job
within a bound, with a report naming the host and its ranks."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from meshspeed.testing.harness import run_distributed
from meshspeed.testing.netns import Cluster, namespaces_available
from tests.process import hosts_script

ROOT = Path(__file__).resolve().parents[2]
PORT = 29512
BOUND_S = 150  # every wait of these tests; the jobs' own bounds are well inside it

pytestmark = pytest.mark.skipif(not namespaces_available()[0], reason=namespaces_available()[1])


def _agent(cluster: Cluster, host, out_dir: Path, tag: str, *script_args: str,
           nnodes: str = "2", rdzv_conf: str = "", endpoint=None) -> tuple[subprocess.Popen, Path]:
    """`meshspeed run` on `host` (its half of the job), meeting at `endpoint` (default
    node0); its output goes to a file."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "OMP_NUM_THREADS": "1",
           "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT), "HOME": "/root"}
    h0 = endpoint or cluster.hosts[0]
    log = out_dir / f"agent-{host.name}-{tag}.txt"
    argv = [sys.executable, "-m", "meshspeed.cli", "run", "--nnodes", nnodes, "--node-rank",
            str(host.index), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{h0.addr}:{PORT}",
            "--rdzv-id", "t", "--max-restarts", "2", "--nproc-per-node", "2",
            *(["--rdzv-conf", rdzv_conf] if rdzv_conf else []),
            str(Path(hosts_script.__file__)), str(out_dir), *script_args]
    with open(log, "w") as f:
        proc = host.popen(argv, env=env, cwd=str(out_dir), stdout=f, stderr=subprocess.STDOUT)
    return proc, log


def _wait_steps(log: Path, at_least: int, proc: subprocess.Popen) -> None:
    """Until rank 0 has logged `at_least` steps (bounded)."""
    deadline = time.monotonic() + BOUND_S
    while time.monotonic() < deadline:
        if log.exists() and len(log.read_text().splitlines()) >= at_least:
            return
        if proc.poll() is not None:
            raise AssertionError(f"the job ended (rc {proc.returncode}) before step {at_least}")
        time.sleep(0.2)
    raise AssertionError(f"rank 0 did not reach step {at_least} within {BOUND_S} s")


def _finish(proc: subprocess.Popen, timeout: float = BOUND_S) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
        raise AssertionError(f"the agent did not end within {timeout} s") from None


def _steps(log: Path) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for line in log.read_text().splitlines():
        attempt, step, loss = re.fullmatch(r"attempt (\S+) step (\d+) loss (\S+)", line).groups()
        out.setdefault(attempt, []).append((int(step), float(loss)))
    return out


# lost=0: the host started again is node0, which sorts first and so is the new round's rank
# 0, serving a store of its own (Note [the bootstrap store of a joining host]); the rendezvous
# endpoint is then on node1, the host that stays
@pytest.mark.parametrize("lost", [1, 0])
def test_a_killed_host_started_again_resumes_the_job_exactly(tmp_path, lost):
    with Cluster(tmp_path, hosts=2) as cluster:
        victim, survivor = cluster.hosts[lost], cluster.hosts[1 - lost]
        out = cluster.shared_path
        ps, _ = _agent(cluster, survivor, out, "first", endpoint=survivor)
        _agent(cluster, victim, out, "first", endpoint=survivor)
        _wait_steps(out / "log-rank0.txt", hosts_script.EVERY + 2, ps)
        victim.kill()  # every process of the host, its agent included
        victim.boot()
        pv, _ = _agent(cluster, victim, out, "again", endpoint=survivor)
        rcs, rcv = _finish(ps), _finish(pv)
        text = "".join(f.read_text() for f in sorted(out.glob("agent-*.txt")))
        assert (rcs, rcv) == (0, 0), text[-6000:]
    if lost == 1:  # rank 0 (on node0, which stayed) names the lost ranks with their host
        assert re.search(r"rank [23] on host node1 \(process \d+\)", text), text[-6000:]
    assert "connectFullMesh" not in text, text[-6000:]
    steps = _steps(out / "log-rank0.txt")
    assert sorted(steps) == ["0", "1"], steps  # one restart, numbered alike on both hosts
    run_distributed(hosts_script.train, 4, args=(str(tmp_path), 0.0), timeout=240)
    reference = _steps(tmp_path / "log-rank0.txt")["0"]
    assert [s for s, _ in reference] == list(range(hosts_script.TOTAL))
    assert steps["1"] == reference[steps["1"][0][0]:]  # the resumed steps, bit for bit
    resumed, uninterrupted = torch.load(out / "final.pt"), torch.load(tmp_path / "final.pt")
    for name, value in uninterrupted.items():
        assert torch.equal(resumed[name], value), f"{name} differs from the uninterrupted run"


def test_a_host_that_never_returns_ends_the_job_naming_it_and_its_ranks(tmp_path):
    with Cluster(tmp_path, hosts=2) as cluster:
        h0, h1 = cluster.hosts
        out = cluster.shared_path
        p0, log0 = _agent(cluster, h0, out, "first")
        _agent(cluster, h1, out, "first")
        _wait_steps(out / "log-rank0.txt", 2, p0)
        h1.kill()
        killed = time.monotonic()
        rc0 = _finish(p0)
        waited = time.monotonic() - killed
        text = log0.read_text()
    assert rc0 != 0, text[-6000:]
    # the survivors' wait is bounded by comms_timeout plus the rendezvous keep-alive expiry
    # (Note [a host that does not come back]), not torch's 600 s join timeout
    assert waited < hosts_script.COMMS_TIMEOUT_S + 15 + 60, waited
    assert re.search(r"meshspeed: rank 2 on host node1, rank 3 on host node1: did not join "
                     r"attempt 1 within \d+ s", text), text[-6000:]


def test_a_cut_link_is_reported_as_an_unreachable_host_and_the_job_ends(tmp_path):
    with Cluster(tmp_path, hosts=2) as cluster:
        h0, h1 = cluster.hosts
        out = cluster.shared_path
        p0, log0 = _agent(cluster, h0, out, "first")
        p1, _ = _agent(cluster, h1, out, "first")
        _wait_steps(out / "log-rank0.txt", 2, p0)
        cluster.cut(h1)
        rc0 = _finish(p0)
        text = log0.read_text()
        h1.kill()
        p1.wait(timeout=30)
    assert rc0 != 0, text[-6000:]
    assert re.search(r"rank [23] on host node1 \(process \d+\): unreachable since \d\d:\d\d:\d\d",
                     text), text[-6000:]
    assert re.search(r"rank 2 on host node1, rank 3 on host node1: did not join attempt 1", text), text[-6000:]


def test_a_rank_killed_on_another_host_is_named_dead_with_its_host(tmp_path):
    with Cluster(tmp_path, hosts=2) as cluster:
        h0, h1 = cluster.hosts
        out = cluster.shared_path
        kill_at = hosts_script.EVERY + 1
        p0, log0 = _agent(cluster, h0, out, "first", str(kill_at))
        p1, log1 = _agent(cluster, h1, out, "first", str(kill_at))
        rc0, rc1 = _finish(p0), _finish(p1)
        text = log0.read_text()
        assert (rc0, rc1) == (0, 0), (text + log1.read_text())[-6000:]
    assert (out / "killed").exists(), "rank 3 never killed itself: the test tested nothing"
    # node0 learns it from node1's survivor (rank 2 posts it as it is stopped)
    assert re.search(r"rank 3 on host node1 \(process \d+\): died", text), text[-6000:]
    assert sorted(_steps(out / "log-rank0.txt")) == ["0", "1"]


def test_a_host_joining_an_elastic_job_is_reported_as_a_join(tmp_path):
    with Cluster(tmp_path, hosts=2) as cluster:
        h0, h1 = cluster.hosts
        out = cluster.shared_path
        # a short last call: the first round need not wait 30 s for a second host
        p0, log0 = _agent(cluster, h0, out, "first", nnodes="1:2", rdzv_conf="last_call_timeout=2")
        _wait_steps(out / "log-rank0.txt", 1, p0)
        p1, log1 = _agent(cluster, h1, out, "first", nnodes="1:2", rdzv_conf="last_call_timeout=2")
        rc0, rc1 = _finish(p0), _finish(p1)
        text = log0.read_text()
        assert (rc0, rc1) == (0, 0), (text + log1.read_text())[-6000:]
    assert "meshspeed: host node1 joined; the job restarts at the new size" in text, text[-6000:]
    assert re.search(r"meshspeed: rank 0 stopped by the launcher \(SIGTERM\) at .*: host node1 "
                     r"joined; the job restarts at the new size", text), text[-6000:]
    assert "died" not in text, text[-6000:]
    assert sorted(_steps(out / "log-rank0.txt")) == ["0", "1"]  # grown: attempt 1 on 4 ranks


def test_an_elastic_job_goes_on_without_a_host_that_never_returns(tmp_path):
    with Cluster(tmp_path, hosts=2) as cluster:
        h0, h1 = cluster.hosts
        out = cluster.shared_path
        p0, log0 = _agent(cluster, h0, out, "first", nnodes="1:2", rdzv_conf="last_call_timeout=2")
        _agent(cluster, h1, out, "first", nnodes="1:2", rdzv_conf="last_call_timeout=2")
        _wait_steps(out / "log-rank0.txt", hosts_script.EVERY + 1, p0)
        h1.kill()
        rc0 = _finish(p0)
        text = log0.read_text()
    assert rc0 == 0, text[-6000:]
    assert re.search(r"rank [23] on host node1 \(process \d+\): unreachable since", text), text[-6000:]
    assert "did not join" not in text, text[-6000:]
    steps = _steps(out / "log-rank0.txt")
    assert sorted(steps) == ["0", "1"] and steps["1"][-1][0] == hosts_script.TOTAL - 1, steps
