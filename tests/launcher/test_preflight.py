"""The master-address check every host runs before a job (meshspeed/launcher/preflight.py)."""

from __future__ import annotations

import socket

from meshspeed.launcher import preflight


def test_master_checks(monkeypatch):
    assert preflight.check_master("127.0.0.1") == (
        None, "resolves to the loopback address 127.0.0.1, which other hosts cannot reach")
    assert preflight.check_master("198.18.3.1") == ("198.18.3.1", None)
    addr, problem = preflight.check_master("no-such-host.invalid")
    assert addr is None and problem.startswith("does not resolve (")
    assert preflight.sentence("node1", "node0", "does not resolve (x)", "198.18.3.1") == (
        "meshspeed run: on node1, the master address 'node0' does not resolve (x); use an address every "
        "host resolves, e.g. --master_addr 198.18.3.1")


def test_own_name_on_loopback_is_a_warning(monkeypatch):
    monkeypatch.setattr(socket, "gethostname", lambda: "localhost")
    assert "own name 'localhost' resolves to the loopback address" in preflight.own_name_warning({})
    assert preflight.own_name_warning({"GLOO_SOCKET_IFNAME": "eth0"}) is None
    monkeypatch.setattr(socket, "gethostname", lambda: "198.18.3.1")
    assert preflight.own_name_warning({}) is None
