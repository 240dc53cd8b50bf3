"""The host registry's pure parts: which attempt a rank is in (Note [attempts every host
agrees on]) and the report line of one rank (Note [host registry and heartbeat])."""

from __future__ import annotations

import time

from meshspeed.comm import registry
from meshspeed.comm.registry import Peer, peer_line, peer_state
from meshspeed.testing.harness import run_distributed


def test_the_agents_round_wins_over_the_per_node_restart_counter():
    # a relaunched host's agent restarts its counter at 0; the round is the same everywhere
    assert registry.attempt({"MESHSPEED_RDZV_ROUND": "2", "TORCHELASTIC_RESTART_COUNT": "0"}) == "round2"
    assert registry.attempt({"MESHSPEED_RDZV_ROUND": "2", "TORCHELASTIC_RESTART_COUNT": "1"}) == "round2"
    assert registry.attempt_number({"MESHSPEED_RDZV_ROUND": "2"}) == 2


def test_without_a_round_the_restart_counter_names_the_attempt():
    assert registry.attempt({"TORCHELASTIC_RESTART_COUNT": "3"}) == "3"
    assert registry.attempt({}) == "0"
    assert registry.attempt({"MESHSPEED_RDZV_ROUND": ""}) == "0"


def test_report_lines_name_the_host_and_process():
    now = time.time()
    fresh = Peer(3, "node1", 812, "round1", now - 0.5)
    assert peer_line(fresh, 3, now) == "rank 3 on host node1 (process 812): still computing"
    dead = Peer(3, "node1", 812, "round1", now - 0.5, died=True)
    assert peer_line(dead, 3, now) == "rank 3 on host node1 (process 812): died"
    beat = now - 60
    silent = Peer(3, "node1", 812, "round1", beat)
    since = time.strftime("%H:%M:%S", time.localtime(beat))
    assert peer_line(silent, 3, now) == f"rank 3 on host node1 (process 812): unreachable since {since}"
    assert peer_line(None, 5, now) == "rank 5 (never registered): did not answer"


def test_a_beat_is_stale_only_after_several_missed_beats():
    now = time.time()
    assert peer_state(Peer(0, "h", 1, "0", now - registry.BEAT_S * 2), now) == "still computing"
    assert peer_state(Peer(0, "h", 1, "0", now - registry.STALE_S - 0.1), now).startswith("unreachable since")


def _registered() -> tuple[str, int, bool]:
    # lazy: only the ranks need torch.distributed
    import os
    import socket

    import torch.distributed as dist

    from meshspeed.comm import rollcall

    rollcall.introduce()  # what init_distributed does at start
    time.sleep(registry.STALE_S + 1)  # stale by now, but for the heartbeat
    peer = registry.read(None, 1 - dist.get_rank())
    return peer.host == socket.gethostname(), peer.pid != os.getpid(), time.time() - peer.beat < registry.STALE_S


def test_every_rank_is_registered_with_its_host_and_keeps_beating():
    assert run_distributed(_registered, 2) == [(True, True, True)] * 2


def _address_named() -> str:
    # lazy: only the ranks need the registry's store
    import socket

    from meshspeed.comm import rollcall

    rollcall.introduce()
    return registry.describe_address("127.0.0.1", 4242), socket.gethostname()


def test_an_address_in_a_backend_error_is_named_with_its_host_and_ranks():
    text, host = run_distributed(_address_named, 2)[0]
    # both ranks run on this machine, at the loopback address the harness uses
    assert text == f"host {host} (ranks 0, 1) at 127.0.0.1:4242", text
    assert registry.describe_address("198.18.0.9", 1) == "198.18.0.9:1"  # nothing registered
