"""checkpoint.use_node_local_storage on one machine (tests/checkpoint/test_node_local_hosts.py
runs it across namespaced hosts): the pure parts (storage groups, the transfer plan, the
hostfile), the key on one host (one disk: the usual save, exact resume), a failure during
a node-local save, the one-sentence error for ranks that do not see rank 0's directory,
auto_resume's agreement across disks, and `meshspeed gather-checkpoint` through a stand-in
ssh that maps each host name to a directory."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from meshspeed.checkpoint import CheckpointError
from meshspeed.checkpoint.fetch import plan_transfers
from meshspeed.checkpoint.gather import gather, read_hosts
from meshspeed.checkpoint.hosts import Placement, storage_groups
from meshspeed.testing.harness import run_distributed
from tests.checkpoint import node_local_workers as w
from tests.checkpoint import workers

REPO = Path(__file__).resolve().parents[2]


# -- pure parts ---------------------------------------------------------------------------------
def test_storage_groups_follow_what_each_rank_sees():
    assert storage_groups([(0, 2), (0, 2), (0, 2), (0, 2)]) == [[0, 1, 2, 3]]  # shared
    assert storage_groups([(0,), (0,), (2,), (2,)]) == [[0, 1], [2, 3]]  # two disks
    # one shared disk, where ranks 2 and 3 saw rank 0's probe late: still one disk
    assert storage_groups([(0, 2), (0, 2), (2,), (2,)]) == [[0, 1, 2, 3]]
    assert storage_groups([(0,), (0,), (), ()]) == [[0, 1], [2], [3]]  # 2, 3 see nothing


def test_placement_names_hosts_and_leaders():
    p = Placement(("node0", "node0", "node1", "node1"))
    assert p.hosts == ["node0", "node1"]
    assert [p.leader(r) for r in range(4)] == [0, 0, 2, 2]
    assert p.describe([2, 3]) == "ranks 2, 3 (on node1)"
    assert p.describe([1]) == "rank 1 (on node0)"


def test_transfers_send_each_missing_file_once_per_host():
    meta = {"files": {"a": {}, "b": {}, "c": {}}}
    p = Placement(("n0", "n0", "n1", "n1"))
    have = [["a"], ["a"], ["b"], ["b"]]
    lack = [[], ["b"], ["a"], ["a"]]  # rank 1 needs b; both ranks of n1 need a: one transfer
    transfers, unheld = plan_transfers(meta, p, have, lack)
    assert transfers == [("a", 0, 2), ("b", 3, 1)]  # senders taken in turn among the holders
    assert unheld == {}
    _, unheld = plan_transfers(meta, p, have, [["c"], [], [], []])
    assert unheld == {"c": ["n0"]}


def test_hostfile_hosts(tmp_path):
    hf = tmp_path / "hostfile"
    hf.write_text("# two hosts\nnode0 slots=2\n\nnode1 slots=2  # the second\nnode0 slots=2\n")
    assert read_hosts(str(hf)) == ["node0", "node1"]
    (tmp_path / "empty").write_text("# none\n")
    with pytest.raises(CheckpointError, match="names no host"):
        read_hosts(str(tmp_path / "empty"))


# -- one host: the key changes nothing but the metadata -------------------------------------------
@pytest.mark.parametrize("stage", [0, 3])
def test_the_key_on_one_host_resumes_exactly(tmp_path, stage):
    out = run_distributed(w.resume_local, 2, args=(str(tmp_path / "ckpt"), stage))
    assert out[0]["equal"] and out[1]["equal"]
    assert out[0]["files"] == ["meta.json", "rank-00000.safetensors", "rank-00001.safetensors"]
    assert out[0]["client"] == {"t": 1}
    storage = out[0]["meta"]["storage"]
    assert storage["node_local"] and len(storage["hosts"]) == 2 and len(set(storage["hosts"])) == 1


def test_async_save_with_the_key_is_written_before_returning(tmp_path):
    out = run_distributed(w.resume_local, 2, args=(str(tmp_path / "ckpt"), 2), kwargs={"async_save": True})
    assert out[0]["equal"] and out[1]["equal"]


def test_a_failed_node_local_save_raises_everywhere_and_keeps_latest(tmp_path):
    out = run_distributed(w.full_disk_local, 2, args=(str(tmp_path / "ckpt"), 1))
    assert out[0]["error"] == out[1]["error"]
    assert out[0]["error"].startswith("rank 1: cannot write") and "no space left" in out[0]["error"]
    assert out[0]["latest"] == "global_step1"
    assert out[0]["entries"] == ["global_step1", "latest"]  # the temporary directory is gone


def test_ranks_that_do_not_see_rank0s_directory_fail_in_one_sentence(tmp_path):
    tmp = tmp_path / "ckpt" / "global_step1.tmp-abcd"
    tmp.mkdir(parents=True)
    errors = run_distributed(w.check_shared_with, 2, args=([str(tmp), str(tmp_path / "elsewhere")],
                                                           str(tmp_path / "ckpt")))
    assert errors[0] == errors[1]
    msg = errors[0]
    assert "\n" not in msg and "No such file" not in msg
    assert msg.startswith(f"rank 1 (on {os.uname().nodename}) does not see the checkpoint directory "
                          f"{tmp_path / 'ckpt'} that rank 0")
    assert "set checkpoint.use_node_local_storage: true" in msg
    assert not tmp.exists()  # rank 0 removed its temporary directory


# -- auto_resume across disks ---------------------------------------------------------------------
def _fake_tags(root: Path, tags: dict[str, int], latest: str | None) -> str:
    for tag, steps in tags.items():
        (root / tag).mkdir(parents=True)
        (root / tag / "meta.json").write_text(json.dumps({"counters": {"global_steps": steps}}))
    if latest:
        (root / "latest").write_text(latest)
    root.mkdir(parents=True, exist_ok=True)
    return str(root)


def test_auto_resume_takes_the_newest_checkpoint_complete_on_every_disk(tmp_path):
    a = _fake_tags(tmp_path / "a", {"global_step2": 2, "global_step4": 4}, "global_step4")
    b = _fake_tags(tmp_path / "b", {"global_step2": 2}, "global_step2")  # its step-4 save failed
    out = run_distributed(w.agree_on_resume, 2, args=([a, b],))
    assert out[0] == out[1]
    assert out[0][0] == "global_step2" and "newest complete on every host" in out[0][1]


def test_auto_resume_with_no_common_checkpoint_fails_in_one_sentence(tmp_path):
    a = _fake_tags(tmp_path / "a", {"global_step4": 4}, "global_step4")
    b = _fake_tags(tmp_path / "b", {}, None)  # a new host
    out = run_distributed(w.agree_on_resume, 2, args=([a, b],))
    # (each rank names its own directory here; on hosts it is one path)
    assert out[0].replace(a, b) == out[1] and "\n" not in out[0]
    assert out[0].startswith("auto_resume: ranks [1] do not hold checkpoint 'global_step4'")
    assert "meshspeed gather-checkpoint --hostfile HOSTFILE --tag global_step4" in out[0]


# -- gathering ------------------------------------------------------------------------------------
FAKE_SSH = """#!/bin/sh
# a stand-in for ssh: runs the command here, with $GATHER_SRC replaced by $GATHER_ROOT/<host>
host=$1; shift
exec sh -c "$(printf '%s' "$*" | sed "s#$GATHER_SRC#$GATHER_ROOT/$host#g")"
"""


@pytest.fixture
def two_disks(tmp_path, monkeypatch):
    """A node-local checkpoint at world 2 split over two 'disks' (directories) as two hosts
    would hold it, and an ssh that maps host names to them."""
    saved = tmp_path / "saved"
    run_distributed(workers.save_after, 2, args=(2, [2], str(saved), 1, 2))
    src = saved / "dp2-stage2"
    for host, drop in (("node0", "rank-00001.safetensors"), ("node1", "rank-00000.safetensors")):
        shutil.copytree(src, tmp_path / "disks" / host / "ckpt")
        os.remove(tmp_path / "disks" / host / "ckpt" / "global_step1" / drop)
    ssh = tmp_path / "fake-ssh"
    ssh.write_text(FAKE_SSH)
    ssh.chmod(ssh.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("GATHER_SRC", "/virtual")
    monkeypatch.setenv("GATHER_ROOT", str(tmp_path / "disks"))
    return tmp_path, str(ssh)


def test_gather_makes_one_complete_checkpoint(two_disks):
    root, ssh = two_disks
    said = []
    final = gather(["node0", "node1"], "/virtual/ckpt", None, str(root / "out"), [ssh], say=said.append)
    assert final == str(root / "out" / "global_step1")
    assert sorted(os.listdir(final)) == ["meta.json", "rank-00000.safetensors", "rank-00001.safetensors"]
    assert (root / "out" / "latest").read_text() == "global_step1"
    assert said == [f"{h}: copied /virtual/ckpt/global_step1" for h in ("node0", "node1")]
    assert not [n for n in os.listdir(root / "out") if ".tmp-" in n]
    # the normal loader reads it at another layout (one rank)
    assert run_distributed(workers.load_error, 1, args=(str(root / "out"),)) == [None]


def test_gather_into_a_hosts_own_copy_completes_it(two_disks):
    root, ssh = two_disks
    own = root / "disks" / "node0" / "ckpt"
    gather(["node0", "node1"], "/virtual/ckpt", "global_step1", str(own), [ssh], say=lambda _: None)
    assert sorted(os.listdir(own / "global_step1")) == [
        "meta.json", "rank-00000.safetensors", "rank-00001.safetensors"]


def test_gather_without_a_host_names_the_missing_file(two_disks):
    root, ssh = two_disks
    with pytest.raises(CheckpointError) as err:
        gather(["node0"], "/virtual/ckpt", "global_step1", str(root / "out"), [ssh], say=lambda _: None)
    msg = str(err.value)
    assert "\n" not in msg and "do not make a complete checkpoint" in msg and "rank-00001.safetensors" in msg
    assert not (root / "out" / "global_step1").exists()


def test_gather_command_line(two_disks):
    root, ssh = two_disks
    (root / "hostfile").write_text("node0 slots=1\nnode1 slots=1\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-m", "meshspeed.cli", "gather-checkpoint", "--hostfile",
                        str(root / "hostfile"), "--ssh", ssh, "/virtual/ckpt", "--to", str(root / "cli")],
                       capture_output=True, text=True, timeout=120, env=env, cwd=str(REPO), check=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == (f"gathered {root / 'cli' / 'global_step1'}: a complete "
                                         "checkpoint, loadable at any layout")


def test_the_key_on_a_shared_directory_with_two_hosts_makes_one_checkpoint(tmp_path):
    out = run_distributed(w.shared_disk_two_hostnames, 4, args=(str(tmp_path / "ckpt"),))
    assert all(o["equal"] for o in out)
    assert out[0]["files"] == ["meta.json", *[f"rank-0000{r}.safetensors" for r in range(4)]]
    assert out[0]["meta"]["storage"]["hosts"] == ["hostA", "hostA", "hostB", "hostB"]
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["global_step2", "latest"]


# -- sending files a host lacks -------------------------------------------------------------------
@pytest.fixture
def split_disks(tmp_path):
    """A world-2 checkpoint tag split over two 'disks': each holds meta.json and its rank's file."""
    run_distributed(workers.save_after, 2, args=(2, [2], str(tmp_path / "saved"), 1, 2))
    tag = tmp_path / "saved" / "dp2-stage2" / "global_step1"
    dirs = []
    for r in range(2):
        d = tmp_path / f"disk{r}" / "global_step1"
        shutil.copytree(tag, d)
        os.remove(d / f"rank-0000{1 - r}.safetensors")
        dirs.append(str(d))
    return dirs


def test_a_file_a_host_lacks_is_sent_checked_and_kept(split_disks):
    out = run_distributed(w.fetch_between, 2, args=(split_disks, [["rank-00001.safetensors"], []]))
    assert out[0]["error"] is None and out[1]["error"] is None
    assert out[0]["files"] == ["meta.json", "rank-00000.safetensors", "rank-00001.safetensors"]
    assert out[0]["received"] == os.path.getsize(os.path.join(split_disks[1], "rank-00001.safetensors"))
    assert out[1]["files"] == ["meta.json", "rank-00001.safetensors"]  # it needed nothing
    with open(os.path.join(split_disks[0], "rank-00001.safetensors"), "rb") as a, \
            open(os.path.join(split_disks[1], "rank-00001.safetensors"), "rb") as b:
        assert a.read() == b.read()


def test_a_corrupted_sent_file_is_refused_on_every_rank(split_disks):
    bad = os.path.join(split_disks[1], "rank-00001.safetensors")
    data = bytearray(Path(bad).read_bytes())
    data[-1] ^= 0xFF
    Path(bad).write_bytes(bytes(data))
    out = run_distributed(w.fetch_between, 2, args=(split_disks, [["rank-00001.safetensors"], []]))
    assert out[0]["error"] == out[1]["error"]
    assert out[0]["error"] == ("rank 0: rank-00001.safetensors sent by rank 1 fails its SHA-256 check: its "
                               "copy on that host is corrupted; restore it or load another tag")
    assert out[0]["files"] == ["meta.json", "rank-00000.safetensors"]  # nothing kept
