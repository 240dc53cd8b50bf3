"""The agent's side of restarts across hosts (meshspeed/launcher/rounds.py), without agents:
the c10d rendezvous is swapped for its wrapper, the survivors' bound, joins told apart
from a host coming back, and the message naming a host that does not come back."""

from __future__ import annotations

import time

from torch.distributed.elastic.rendezvous import RendezvousParameters

from meshspeed.comm.registry import Peer
from meshspeed.launcher import rounds


def test_the_c10d_rendezvous_is_swapped_for_the_wrapper_and_the_script_args_are_left():
    argv = ["--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "node0:29512",
            "train.py", "--rdzv-backend", "c10d"]
    assert rounds.rewrite(argv) == ["--nproc-per-node", "2", "--rdzv-backend", rounds.BACKEND,
                                    "--rdzv-endpoint", "node0:29512", "train.py", "--rdzv-backend", "c10d"]
    assert rounds.rewrite(["--rdzv_backend=c10d", "t.py"]) == [f"--rdzv_backend={rounds.BACKEND}", "t.py"]
    assert rounds.rewrite(["--standalone", "t.py"]) == ["--standalone", "t.py"]  # one host: torch's own
    assert rounds.install(["--rdzv-backend", "c10d", "t.py"])[1] == rounds.BACKEND
    assert rounds.install(["t.py"]) == ["t.py"]  # installing twice is fine


def _params(**config) -> RendezvousParameters:
    nodes = config.pop("nodes", (2, 2))
    return RendezvousParameters("meshspeed-c10d", "node0:29512", "t", nodes[0], nodes[1], **config)


def test_the_survivors_wait_is_the_comms_timeout_plus_the_keep_alive_expiry():
    assert rounds.bound_s(20.0, _params()) == 20 + 5 * 3
    assert rounds.bound_s(20.0, _params(keep_alive_interval=2, keep_alive_max_attempt=2)) == 24
    # elastic: the round may complete without the host after the last call
    assert rounds.bound_s(20.0, _params(nodes=(1, 2))) == 20 + 15 + 30
    assert rounds.bound_s(None, _params()) is None  # nothing known: torch's join timeout


def test_a_host_of_the_attempt_back_in_the_rendezvous_is_not_a_join():
    assert rounds.joined_hosts(["node0", "node1"], {"node0", "node1"}, "node0") == []
    assert rounds.joined_hosts(["node2", "node1"], {"node0", "node1"}, "node0") == ["node2"]


def test_the_ranks_that_did_not_come_back_are_named_with_their_host():
    now = time.time()
    missing = {3: Peer(3, "node1", 813, "round0", now), 2: Peer(2, "node1", 812, "round0", now - 60)}
    msg = rounds.missing_message(missing, 1, 35.2)
    assert msg.startswith("meshspeed: rank 2 on host node1, rank 3 on host node1: did not join "
                          "attempt 1 within 35 s (last heard of: unreachable since "), msg
