"""Which host each rank runs on, and whether it still answers: a registry that outlives attempts.

Note [attempts every host agrees on]
Start-up records (the process group's keys, the roll call's) live in a store that outlives
the workers, so each attempt keeps them under its own name. torchrun's restart counter
(TORCHELASTIC_RESTART_COUNT) is kept per node: a host whose agent was started again counts
from 0 while the others are at 1, and it would read the dead attempt's addresses. Under the
c10d rendezvous `meshspeed run` gives the workers MESHSPEED_RDZV_ROUND instead, a number the
agents agree on after each completed rendezvous round (meshspeed/launcher/rounds.py); the
restart counter is the fallback (plain torchrun, the static rendezvous), where every node
restarts together.

Note [host registry and heartbeat]
A rank on another host cannot be looked up in /proc. So each rank registers its host and
pid under its rank in the root of the rendezvous store (not under an attempt: the last
known host of a rank survives its death), and a daemon thread, on its own connection,
refreshes that record every BEAT_S seconds with the time. A peer whose record is older
than STALE_S is unreachable since its last beat (its host died, or the link to the store
is cut); a rank whose host's survivor saw its process gone posts it as dead
(`post_dead`). Cost: one store.set per rank every BEAT_S seconds, off the training thread.
The age of a beat compares two hosts' clocks: they must agree to within a second or so
(NTP, as on any cluster); a clock far behind makes its ranks look unreachable.
"""

from __future__ import annotations

import atexit
import datetime
import json
import os
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

BEAT_S = 1.0
STALE_S = 3.5 * BEAT_S  # no beat for this long: unreachable
ROUND_VAR = "MESHSPEED_RDZV_ROUND"
PREFIX = "meshspeed/hosts"
TIMEOUT_KEY = "meshspeed/comms_timeout"  # rank 0's collective timeout, for the agents' waits


def attempt(environ: Mapping[str, str] = os.environ) -> str:
    """This attempt's name (Note [attempts every host agrees on]): "round3" under
    `meshspeed run`'s c10d rendezvous, else torchrun's restart counter ("0", "1", ...)."""
    if environ.get(ROUND_VAR, "").isdigit():
        return f"round{environ[ROUND_VAR]}"
    return environ.get("TORCHELASTIC_RESTART_COUNT", "0")


def attempt_number(environ: Mapping[str, str] = os.environ) -> int:
    name = attempt(environ)
    return int(name.removeprefix("round")) if name.removeprefix("round").isdigit() else 0


def root_store(store: Any = None) -> Any:
    """The store under every prefix (the default group's by default); None without one."""
    try:
        store = distributed_c10d._get_default_store() if store is None else store
    except Exception:  # noqa: BLE001 - no default group
        return None
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


@dataclass(frozen=True)
class Peer:
    """What the registry knows of one rank."""

    rank: int
    host: str
    pid: int
    attempt: str
    beat: float  # wall-clock time of its last heartbeat
    died: bool = False  # posted dead by a survivor on its host


def peer_line(peer: Peer | None, rank: int, now: float, state: str | None = None) -> str:
    """`rank 3 on host node1 (process 812): died` / `: unreachable since 12:03:05` /
    `: still computing`; `state` overrides what the record says (e.g. "waiting in ...")."""
    if peer is None:
        return f"rank {rank} (never registered): {state or 'did not answer'}"
    head = f"rank {rank} on host {peer.host} (process {peer.pid})"
    if state is None:
        state = peer_state(peer, now)
    return f"{head}: {state}"


def peer_state(peer: Peer, now: float) -> str:
    """"died", "unreachable since HH:MM:SS" or "still computing"."""
    if peer.died:
        return "died"
    if now - peer.beat > STALE_S:
        return f"unreachable since {time.strftime('%H:%M:%S', time.localtime(peer.beat))}"
    return "still computing"


def _parse(rank: int, raw: bytes | str | None, dead: bool) -> Peer | None:
    if raw is None:
        return None
    rec = json.loads(raw)
    return Peer(rank, rec["host"], int(rec["pid"]), str(rec["attempt"]), float(rec["t"]), dead)


def read(store: Any, rank: int) -> Peer | None:
    """The registry's record of `rank`, best effort (None when absent or unreadable)."""
    store = root_store(store)
    try:
        key = f"{PREFIX}/{rank}"
        if store is None or not store.check([key]):
            return None
        raw = store.get(key)
        dead = store.check([_dead_key(rank, attempt())])
        return _parse(rank, raw, dead)
    except Exception:  # noqa: BLE001 - best effort
        return None


def posted_dead(store: Any, ranks: list[int]) -> list[int]:
    """Those of `ranks` posted dead in this attempt by a survivor on their host."""
    store = root_store(store)
    try:
        return [r for r in ranks if store is not None and store.check([_dead_key(r, attempt())])]
    except Exception:  # noqa: BLE001 - best effort
        return []


def post_stopped(store: Any, rank: int) -> None:
    """Say that `rank` is being stopped by its launcher (SIGTERM): when its process is gone,
    it was stopped, it did not die."""
    try:
        root_store(store).set(f"meshspeed/stopped/{attempt()}/{rank}", "1")
    except Exception:  # noqa: BLE001, S110 - best effort
        pass


def was_stopped(store: Any, rank: int) -> bool:
    try:
        return bool(root_store(store).check([f"meshspeed/stopped/{attempt()}/{rank}"]))
    except Exception:  # noqa: BLE001 - best effort
        return False


def joining_key(name: str) -> str:
    """Where an agent posts the hosts waiting to join, before it stops attempt `name`'s
    workers (meshspeed/launcher/rounds.py); the SIGTERM report reads it."""
    return f"meshspeed/joining/{name}"


def returned_key(name: str) -> str:
    """Where an agent posts the hosts of attempt `name` that are back in the rendezvous
    (their agent started again, or their workers failed), before it stops the workers."""
    return f"meshspeed/returned/{name}"


def _dead_key(rank: int, name: str) -> str:
    return f"meshspeed/dead/{name}/{rank}"


def post_dead(store: Any, rank: int, pid: int) -> None:
    """Say that `rank`'s process (on this host) is gone, for ranks on other hosts."""
    try:
        root_store(store).set(_dead_key(rank, attempt()), json.dumps({"pid": pid, "t": time.time()}))
    except Exception:  # noqa: BLE001, S110 - best effort
        pass


def record(rank: int) -> str:
    return json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "addr": _my_addr(),
                       "attempt": attempt(), "t": time.time()})


_addr: dict[str, str] = {}  # MASTER_ADDR -> this host's address toward it


def _my_addr() -> str:
    """The address this host's connections to the rendezvous come from (what peers see:
    a collective's error names it), or "" where it cannot be found."""
    master = os.environ.get("MASTER_ADDR")
    if not master:
        return ""
    if master not in _addr:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((master, 9))  # no packet is sent: this only picks the route
                _addr[master] = s.getsockname()[0]
        except OSError:
            return ""
    return _addr[master]


def describe_address(ip: str, port: str | int) -> str:
    """`host node1 (ranks 2, 3) at 198.18.0.2:41234`: the registered ranks at the address a
    backend's error gives; the bare address where none is registered."""
    store, ranks, host = root_store(), [], None
    try:
        for rank in range(dist.get_world_size()):
            raw = store.get(f"{PREFIX}/{rank}") if store.check([f"{PREFIX}/{rank}"]) else None
            rec = json.loads(raw) if raw is not None else {}
            if rec.get("addr") == ip:
                ranks.append(rank)
                host = rec["host"]
    except Exception:  # noqa: BLE001, S110 - best effort: the address alone
        pass
    if host is None:
        return f"{ip}:{port}"
    which = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
    return f"host {host} ({which}) at {ip}:{port}"


class _Heartbeat:
    def __init__(self, store: Any, rank: int) -> None:
        self.store, self.rank, self.stop = store, rank, threading.Event()
        self.thread = threading.Thread(target=self._run, name="meshspeed-heartbeat", daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(BEAT_S):
            try:
                self.store.set(f"{PREFIX}/{self.rank}", record(self.rank))
                if self.rank == 0:
                    seconds = _comms_timeout()
                    if seconds is not None:
                        self.store.set(TIMEOUT_KEY, str(seconds))
            except Exception:  # noqa: BLE001, S110 - unreachable now: try again next beat
                pass

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=BEAT_S + 3)


_beating: list[_Heartbeat] = []


def _comms_timeout() -> float | None:
    """The default group's collective timeout in seconds (None where it cannot be read)."""
    try:
        backend = dist.group.WORLD._get_backend(torch.device("cpu"))
        return backend.options._timeout.total_seconds()
    except Exception:  # noqa: BLE001 - another backend: the agents fall back to their own bound
        return None


def register(rank: int) -> None:
    """Post this rank's host and pid at the root of the default store, and keep it fresh
    from a daemon thread on a connection of its own (Note [host registry and heartbeat]).
    Idempotent per process; best effort."""
    store = root_store()
    if store is None:
        return
    try:
        store.set(f"{PREFIX}/{rank}", record(rank))
        own = store.clone()  # a TCPStore: a connection of the thread's own
        own.set_timeout(datetime.timedelta(seconds=BEAT_S * 2))
    except Exception:  # noqa: BLE001 - a store that cannot be cloned: registered, no heartbeat
        return
    for old in _beating:
        old.close()
    _beating[:] = [_Heartbeat(own, rank)]
    _beating[0].thread.start()


def stop() -> None:
    """End the heartbeat (at exit, so the thread is idle while the interpreter tears down)."""
    for beat in _beating:
        beat.close()
    _beating.clear()


atexit.register(stop)
