"""Checkpoints on node-local disks across real (namespaced) hosts: 2 hosts x 2 ranks, the
save directory `cluster.local_path`, one path that is each host's own disk.

With checkpoint.use_node_local_storage each disk holds its ranks' files and the metadata;
the same layout resumes bit-exactly; another layout with both hosts reads what it lacks
over the network; a layout without node1 fails in one sentence naming
`meshspeed gather-checkpoint`, which (over ssh) makes a complete copy that loads. Without
the key the first save fails in one sentence naming the key. Every run is bounded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshspeed.testing.netns import Cluster, sshd_available

ok, reason = sshd_available()
pytestmark = pytest.mark.skipif(not ok, reason=reason)

REPO = Path(__file__).resolve().parents[2]
SCRIPT = str(REPO / "tests" / "checkpoint" / "node_local_train.py")
STEPS, SAVE_AT = 4, 2
RUN_TIMEOUT_S = 150
_ports = iter(range(29511, 29600))


def _env() -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/root", "PYTHONPATH": str(REPO),
            "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "eth0", "MESHSPEED_TEST_QUIET": "1"}


def launch(cluster: Cluster, hosts, nproc: int, args: list[str], name: str) -> dict:
    """torchrun (static rendezvous) on each of `hosts`; rank 0's OUT.json, with each host's log."""
    out = cluster.shared_path / f"{name}.json"
    port = str(next(_ports))
    procs, logs = [], []
    for i, h in enumerate(hosts):
        log = open(cluster.shared_path / f"{name}-{h.name}.log", "wb")  # noqa: SIM115 - closed below
        logs.append(log)
        procs.append(h.popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(hosts)),
                              "--node-rank", str(i), "--master-addr", hosts[0].addr, "--master-port", port,
                              "--nproc-per-node", str(nproc), SCRIPT, *args, str(out)],
                             env=_env(), cwd=str(REPO), stdout=log, stderr=subprocess.STDOUT))
    try:
        for p in procs:
            p.wait(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        for h in hosts:
            h.kill()
            h.boot()
        raise
    finally:
        for log in logs:
            log.close()
    text = "\n".join((cluster.shared_path / f"{name}-{h.name}.log").read_text(errors="replace")[-3000:]
                     for h in hosts)
    assert out.exists(), f"{name}: no result; exit codes {[p.returncode for p in procs]}\n{text}"
    result = json.loads(out.read_text())
    result["codes"], result["log"] = [p.returncode for p in procs], text
    return result


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with Cluster(tmp_path_factory.mktemp("hosts"), hosts=2, sshd=True) as c:
        yield c


@pytest.fixture(scope="module")
def saved(cluster):
    """2 hosts x 2 ranks, ZeRO-2: STEPS steps, saving after SAVE_AT."""
    save_dir = str(cluster.local_path / "run")
    r = launch(cluster, cluster.hosts, 2, [save_dir, "--steps", str(STEPS), "--save-at", str(SAVE_AT)], "save")
    assert r["error"] is None and r["codes"] == [0, 0], r
    return save_dir, r["losses"]


def _listing(host, path: str) -> list[str]:
    return host.run(["ls", "-A", path], env=_env()).stdout.split()


def test_each_host_holds_its_ranks_files_and_the_metadata(cluster, saved):
    save_dir, _ = saved
    tag = f"global_step{SAVE_AT}"
    node0, node1 = cluster.hosts
    assert _listing(node0, save_dir) == ["global_step2", "latest"]
    assert _listing(node1, save_dir) == ["global_step2", "latest"]
    assert _listing(node0, f"{save_dir}/{tag}") == ["meta.json", "rank-00000.safetensors", "rank-00001.safetensors"]
    assert _listing(node1, f"{save_dir}/{tag}") == ["meta.json", "rank-00002.safetensors", "rank-00003.safetensors"]
    metas = [json.loads((h.disk / "run" / tag / "meta.json").read_text()) for h in cluster.hosts]
    assert metas[0] == metas[1]
    assert metas[0]["storage"] == {"node_local": True, "hosts": ["node0", "node0", "node1", "node1"]}


def test_the_same_layout_resumes_exactly(cluster, saved):
    save_dir, losses = saved
    r = launch(cluster, cluster.hosts, 2, [save_dir, "--steps", str(STEPS), "--resume"], "same")
    assert r["error"] is None, r["log"]
    assert r["loaded"].endswith(f"global_step{SAVE_AT}")
    assert r["losses"] == losses[SAVE_AT:]


def test_a_layout_without_node1_fails_naming_the_gather_command(cluster, saved):
    save_dir, _ = saved
    r = launch(cluster, cluster.hosts[:1], 2, [save_dir, "--steps", str(STEPS), "--resume"], "one-host")
    msg = r["error"]
    assert msg is not None and r["losses"] == [], r["log"]
    assert "\n" not in msg and "node-local" in msg and "No such file" not in msg
    assert f"meshspeed gather-checkpoint --hostfile HOSTFILE --tag global_step{SAVE_AT} {save_dir}" in msg


def test_gathered_checkpoint_loads_on_one_host(cluster, saved):
    save_dir, losses = saved
    node0 = cluster.hosts[0]
    gathered = str(cluster.local_path / "gathered")
    g = node0.run([sys.executable, "-m", "meshspeed.cli", "gather-checkpoint", "--hostfile",
                   str(cluster.hostfile(slots=2)), save_dir, "--to", gathered], env=_env(), cwd=str(REPO),
                  timeout=120)
    assert g.returncode == 0, g.stderr
    assert "node1: copied" in g.stdout and "a complete checkpoint" in g.stdout
    assert _listing(node0, f"{gathered}/global_step{SAVE_AT}") == [
        "meta.json", *[f"rank-0000{r}.safetensors" for r in range(4)]]
    r = launch(cluster, cluster.hosts[:1], 2, [gathered, "--steps", str(STEPS), "--resume"], "gathered")
    assert r["error"] is None, r["log"]
    assert r["losses"] == pytest.approx(losses[SAVE_AT:], rel=1e-5)


def test_another_layout_on_both_hosts_reads_over_the_network(cluster, saved):
    """2 hosts x 1 rank, node1 first: new rank 0 (on node1) needs the ranges old ranks 0 and 1
    saved on node0, new rank 1 (on node0) old ranks 2 and 3's, on node1."""
    save_dir, losses = saved
    node0, node1 = cluster.hosts
    r = launch(cluster, [node1, node0], 1, [save_dir, "--steps", str(STEPS), "--resume"], "two-by-one")
    assert r["error"] is None, r["log"]
    assert r["world"] == 2
    assert r["losses"] == pytest.approx(losses[SAVE_AT:], rel=1e-5)
    # what arrived is kept on each host's disk (checked against meta.json on arrival)
    tag = f"{save_dir}/global_step{SAVE_AT}"
    assert {"rank-00000.safetensors", "rank-00001.safetensors"} <= set(_listing(node1, tag))
    assert {"rank-00002.safetensors", "rank-00003.safetensors"} <= set(_listing(node0, tag))


def test_without_the_key_the_first_save_fails_in_one_sentence(cluster):
    save_dir = str(cluster.local_path / "nokey")
    r = launch(cluster, cluster.hosts, 2, [save_dir, "--steps", "2", "--save-at", "1", "--no-key"], "nokey")
    msg = r["error"]
    assert msg is not None and len(r["losses"]) == 1, r["log"]  # the first save, after step 1
    assert "\n" not in msg and "No such file" not in msg
    assert msg.startswith("ranks 2, 3 (on node1) do not see the checkpoint directory")
    assert "checkpoint.use_node_local_storage" in msg
    # nothing left behind: rank 0 removed its temporary directory
    assert _listing(cluster.hosts[0], save_dir) == []


def test_a_failure_on_one_host_raises_everywhere_and_moves_no_hosts_latest(cluster):
    save_dir = str(cluster.local_path / "fail")
    r = launch(cluster, cluster.hosts, 2, [save_dir, "--steps", "4", "--save-at", "2", "--save-at", "4",
                                           "--full-disk-rank", "3"], "fail")
    assert r["error"].startswith("rank 3: cannot write") and "no space left on device" in r["error"], r["log"]
    for h in cluster.hosts:  # no temporary directory left, `latest` as it was
        assert _listing(h, save_dir) == ["global_step2", "latest"]
        assert h.run(["cat", f"{save_dir}/latest"], env=_env()).stdout == "global_step2"


def test_auto_resume_takes_the_newest_checkpoint_on_every_host_and_a_new_host_is_told(cluster):
    save_dir = str(cluster.local_path / "run2")
    node1 = cluster.hosts[1]
    r = launch(cluster, cluster.hosts, 2, [save_dir, "--steps", "4", "--save-at", "2", "--save-at", "4"], "run2")
    assert r["error"] is None, r["log"]
    # node1's disk lost global_step4 (as if its save had failed there): resume from global_step2
    node1.run(["sh", "-c", f"rm -r {save_dir}/global_step4 && echo global_step2 > {save_dir}/latest"],
              env=_env(), check=True)
    a = launch(cluster, cluster.hosts, 2, [save_dir, "--steps", "4", "--resume", "--auto-resume"], "auto")
    assert a["error"] is None, a["log"]
    assert a["loaded"].endswith("global_step2") and a["losses"] == r["losses"][2:]
    # a host whose disk holds nothing (a replaced host): one sentence naming it and the command
    node1.run(["rm", "-r", save_dir], env=_env(), check=True)
    n = launch(cluster, cluster.hosts, 2, [save_dir, "--steps", "4", "--resume"], "new-host")
    msg = n["error"]
    assert msg is not None and "\n" not in msg, n["log"]
    assert msg == (f"ranks 2, 3 (on node1) lack checkpoint {save_dir}/global_step4, saved on "
                   "node-local disks and held by node0: run `meshspeed gather-checkpoint --hostfile "
                   f"HOSTFILE --tag global_step4 {save_dir}` on node1 (it copies every host's files "
                   "there over ssh)")
