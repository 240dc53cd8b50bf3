"""The several-host fixture (Note [hosts made of namespaces]): each host has its own name,
address, processes, /etc/hosts and local disk; hosts reach each other over the switch, a
cut link does not, killing a host kills all its processes, and ssh works between hosts."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

import pytest

from meshspeed.testing.netns import Cluster, namespaces_available, sshd_available

ok, reason = namespaces_available()
pytestmark = pytest.mark.skipif(not ok, reason=reason)

ENV = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
_SERVE = ("import socket,sys; s=socket.socket(); s.bind((sys.argv[1], 29600)); s.listen(); "
          "print('listening', flush=True); c,_=s.accept(); c.sendall(socket.gethostname().encode()); c.close()")
_ASK = ("import socket,sys; c=socket.create_connection((sys.argv[1], 29600), timeout=3); "
        "print(c.recv(100).decode())")


def test_hosts_are_apart_and_reach_each_other(tmp_path):
    with Cluster(tmp_path, hosts=2) as cluster:
        h0, h1 = cluster.hosts
        assert [h.run(["hostname"], env=ENV).stdout.strip() for h in cluster.hosts] == ["node0", "node1"]
        assert h0.addr.startswith("198.18.") and h1.addr.startswith("198.18.")
        # the same path is each host's own disk; the shared path is one directory
        for h in cluster.hosts:
            h.run(["sh", "-c", f"echo {h.name} > {cluster.local_path}/who"], env=ENV, check=True)
        assert [(h.disk / "who").read_text().strip() for h in cluster.hosts] == ["node0", "node1"]
        h1.run(["sh", "-c", f"echo from-node1 > {cluster.shared_path}/note"], env=ENV, check=True)
        assert h0.run(["cat", f"{cluster.shared_path}/note"], env=ENV).stdout.strip() == "from-node1"
        # names resolve through the host's own /etc/hosts, and the switch carries TCP
        server = h1.popen([sys.executable, "-c", _SERVE, h1.addr], env=ENV, stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout.readline().strip() == "listening"
            answer = h0.run([sys.executable, "-c", _ASK, "node1"], env=ENV, timeout=20)
            assert answer.stdout.strip() == "node1", answer.stderr
        finally:
            server.kill()
        # a cut link: node1 is unreachable, until mended
        cluster.cut(h1)
        cut = h0.run([sys.executable, "-c", _ASK, "node1"], env=ENV, timeout=20)
        assert cut.returncode != 0
        cluster.mend(h1)


def test_killing_a_host_kills_all_its_processes_and_it_boots_again(tmp_path):
    with Cluster(tmp_path, hosts=2) as cluster:
        h1 = cluster.hosts[1]
        # a duration no other process on the machine has (a plain `sleep 300` elsewhere, a
        # developer's shell waiting on this very suite, failed the machine-wide check below)
        seconds = f"300.{os.getpid()}"
        procs = [h1.popen(["sleep", seconds], env=ENV) for _ in range(3)]
        deadline = time.monotonic() + 20
        while sum(f"sleep {seconds}" in p for p in h1.processes()) < 3:  # nsenter forks, then execs
            assert time.monotonic() < deadline, h1.processes()
            time.sleep(0.05)
        h1.kill()
        for p in procs:  # the nsenter wrappers return once their child is gone
            p.wait(timeout=20)
        assert not any(f"sleep {seconds}" in c for c in _machine_processes())
        h1.boot()
        assert h1.run(["hostname"], env=ENV).stdout.strip() == "node1"
        assert h1.processes() == []


def _machine_processes() -> list[str]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{entry}/cmdline", "rb") as f:
                out.append(f.read().replace(b"\0", b" ").decode())
    return out


@pytest.mark.skipif(not sshd_available()[0], reason=sshd_available()[1])
def test_ssh_between_hosts(tmp_path):
    with Cluster(tmp_path, hosts=2, sshd=True) as cluster:
        h0 = cluster.hosts[0]
        out = h0.run(["ssh", "node1", "hostname"], env=ENV, timeout=30)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "node1"
