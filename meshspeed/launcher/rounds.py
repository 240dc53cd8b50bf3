"""The agent's side of restarts across hosts: one attempt number every host agrees on, a
bounded wait for a host that does not come back, and joins told apart from deaths.

Note [the agents number the attempts]
Workers key their start-up records by attempt (Note [attempts every host agrees on] in
comm/registry.py). torchrun's restart counter is per agent, so `meshspeed run` wraps the
c10d rendezvous handler (registered as the backend "meshspeed-c10d", through torch's
public handler registry; `install` rewrites `--rdzv-backend c10d` to it): after each
completed rendezvous round, the round's rank-0 agent takes the next number from a counter
in the rendezvous store and posts it under the round's own store prefix, the other agents
read it there, and each agent exports it as MESHSPEED_RDZV_ROUND before it starts its
workers (torchrun's workers inherit the agent's environment). A host whose agent was
started again joins with the number of the round it joined, like the others. Reading
torch's own round counter would need the handler's private state; the counter needs only
the store.

Note [a host that does not come back]
After a failure the surviving agents meet in the next round, which needs every host (or
`--nnodes MIN` of them): by default they wait the rendezvous join timeout (600 s) without
a word. Once a round has completed, the wrapper bounds that wait: the workers' collective
timeout (`comms_timeout`, posted by rank 0's heartbeat), plus the rendezvous keep-alive
expiry (a dead agent's place is freed only then), plus the last-call time when elastic.
It says which host it waits for, from the host registry the workers kept (Note [host
registry and heartbeat]), and at the bound stops naming the ranks and host that did not
come: `rank 2 on host node1, rank 3 on host node1: did not join attempt 2 within 35 s`.
The first round keeps torch's join timeout (hosts may be slow to start).

Note [the bootstrap store of a joining host]
torch 2.13 shares the rank-0 agent's TCP store with the workers, and publishes its address
in a round's store only when that agent first makes it: a host joining a later round (a
relaunched host, or growing) waits for an address nobody posts, and fails
("DistStoreError ... MASTER_ADDR"). And when the round's rank 0 is new to the job (ranks
follow the sorted host names, so a relaunched host can be rank 0), it serves a new store
while the others, having cached the old one, send their workers there: the job deadlocks.
The wrapper's rank-0 agent posts the address in every round, and every other agent takes
the posted one. So meshspeed keeps torch's shared store (the host registry lives in it and
must outlive an attempt) rather than TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, which would give
each attempt a store of its own, hosted by worker rank 0 and lost with it.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous.api import (
    RendezvousStoreInfo,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
from torch.distributed.run import get_args_parser

from meshspeed.comm import registry

BACKEND = "meshspeed-c10d"
_FLAGS = ("--rdzv-backend", "--rdzv_backend")
_COUNTER = "meshspeed/rdzv/attempts"
_ARRIVALS = "meshspeed/rdzv/arrivals"
_ATTEMPT = "meshspeed/attempt"  # under the round's prefix
NOTE_S = 10.0  # how often a waiting agent says whom it waits for
_MAX_RANKS = 4096  # the registry is read up to the first rank with no record


def rewrite(argv: list[str]) -> list[str]:
    """torchrun arguments with the c10d rendezvous replaced by BACKEND (the same rendezvous,
    wrapped); the script's own arguments are left alone."""
    try:
        parsed = get_args_parser().parse_args(argv)
        head = len(argv) - 1 - len(parsed.training_script_args)
    except SystemExit:  # torchrun will say what is wrong with them
        return list(argv)
    out = list(argv)
    for i in range(head):
        name, eq, value = out[i].partition("=")
        if out[i] in _FLAGS and i + 1 < head and out[i + 1] == "c10d":
            out[i + 1] = BACKEND
        elif eq and name in _FLAGS and value == "c10d":
            out[i] = f"{name}={BACKEND}"
    return out


def install(argv: list[str]) -> list[str]:
    """Register BACKEND with torch's rendezvous registry (once) and return `argv` using it."""
    try:
        rendezvous_handler_registry.register(BACKEND, _create)
    except ValueError:  # another creator holds the name
        raise RuntimeError(f"the rendezvous backend name {BACKEND!r} is taken by another "
                           "handler; meshspeed's cannot be installed") from None
    return rewrite(argv)


def _create(params: RendezvousParameters) -> RendezvousHandler:
    backend, store = create_backend(params)
    return RoundHandler(create_handler(store, backend, params), store, params)


def bound_s(comms_timeout: float | None, params: RendezvousParameters) -> float | None:
    """How long the survivors wait for a host after a failure (Note [a host that does not
    come back]); None: no bound of ours (torch's join timeout)."""
    if comms_timeout is None:
        env = os.environ.get("MESHSPEED_RDZV_TIMEOUT", "")
        comms_timeout = float(env) if env.replace(".", "", 1).isdigit() else None
    if comms_timeout is None:
        return None
    expiry = params.get_as_int("keep_alive_interval", 5) * params.get_as_int("keep_alive_max_attempt", 3)
    last_call = params.get_as_int("last_call_timeout", 30) if params.min_nodes < params.max_nodes else 0
    return comms_timeout + expiry + last_call


def missing_message(missing: dict[int, registry.Peer], attempt: int, waited: float) -> str:
    """`rank 2 on host node1, rank 3 on host node1: did not join attempt 2 within 35 s`."""
    now = time.time()
    names = ", ".join(f"rank {r} on host {p.host}" for r, p in sorted(missing.items()))
    states = {registry.peer_state(p, now) for p in missing.values()} - {"still computing"}
    last = f" (last heard of: {', '.join(sorted(states))})" if states else ""
    return (f"meshspeed: {names or 'a host of the previous attempt'}: did not join attempt "
            f"{attempt} within {waited:.0f} s{last}; its host died, or cannot reach the "
            "rendezvous. The job stops here; start that host again (or use --nnodes MIN:MAX "
            "to go on without it)")


def joined_hosts(arrived: list[str], attempt_hosts: set[str], me: str) -> list[str]:
    """Hosts waiting in the rendezvous that are new to the job: not this host, and none of
    the current attempt's (those are back because their workers stopped: a failure)."""
    return sorted(set(arrived) - attempt_hosts - {me})


class RoundHandler(RendezvousHandler):
    """torch's c10d rendezvous handler, with the attempt number, the bounded wait and the
    join report of this module's Notes. Every other call is the inner handler's."""

    def __init__(self, inner: RendezvousHandler, store: Any, params: RendezvousParameters) -> None:
        self._inner, self._store, self._params = inner, store, params
        self._attempt: int | None = None  # of the last completed round
        self._arrivals_seen = 0
        self._workers: Any = None  # a client of the workers' store
        self._comms_timeout: float | None = None
        self._told_join: int | None = None
        self._host = socket.gethostname()

    # -- the calls we change
    def next_rendezvous(self) -> RendezvousInfo:
        self._store.set(f"{_ARRIVALS}/{self._store.add(_ARRIVALS, 1)}", self._host)
        bound = None
        if self._attempt is not None:
            self._comms_timeout = self._read_comms_timeout() or self._comms_timeout
            bound = bound_s(self._comms_timeout, self._params)
        info = self._join(bound)
        self._attempt = self._agree(info)
        info = self._workers_store_of_the_round(info)
        self._arrivals_seen = int(self._store.add(_ARRIVALS, 0))
        os.environ[registry.ROUND_VAR] = str(self._attempt)  # Note [the agents number the attempts]
        self._workers = self._connect(info)
        return info

    def num_nodes_waiting(self) -> int:
        waiting = self._inner.num_nodes_waiting()
        if waiting > 0 and self._told_join != self._attempt:
            self._told_join = self._attempt
            # a host of this attempt back in the rendezvous lost its workers: not a join
            arrived, before = self._arrived(), self._hosts_now()
            hosts = joined_hosts(arrived, before, self._host)
            back = sorted((set(arrived) & before) - {self._host})
            if back:  # their ranks are gone: the SIGTERM report names them
                try:
                    self._workers.set(registry.returned_key(f"round{self._attempt}"), json.dumps(back))
                except Exception:  # noqa: BLE001, S110 - best effort
                    pass
            if hosts:
                sys.stderr.write(f"meshspeed: host {', '.join(hosts)} joined; the job restarts "
                                 "at the new size\n")
                try:  # before the agent stops the workers: their SIGTERM report reads it
                    self._workers.set(registry.joining_key(f"round{self._attempt}"), json.dumps(hosts))
                except Exception:  # noqa: BLE001, S110 - best effort
                    pass
        return waiting

    # -- the calls we pass on
    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return self._inner.use_agent_store

    def is_closed(self) -> bool:
        return self._inner.is_closed()

    def set_closed(self) -> None:
        self._inner.set_closed()

    def get_run_id(self) -> str:
        return self._inner.get_run_id()

    def shutdown(self) -> bool:
        return self._inner.shutdown()

    # -- helpers
    def _agree(self, info: RendezvousInfo) -> int:
        """The attempt number of the round just completed (Note [the agents number the
        attempts]); rank 0 also posts the workers' store address (Note [the bootstrap
        store of a joining host])."""
        if info.rank == 0:
            number = int(self._store.add(_COUNTER, 1)) - 1
            boot = info.bootstrap_store_info
            if boot is not None and self._inner.use_agent_store:
                info.store.set(RendezvousStoreInfo.MASTER_ADDR_KEY, boot.master_addr.encode())
                info.store.set(RendezvousStoreInfo.MASTER_PORT_KEY, str(boot.master_port).encode())
            info.store.set(_ATTEMPT, str(number))
            return number
        return int(info.store.get(_ATTEMPT))

    def _workers_store_of_the_round(self, info: RendezvousInfo) -> RendezvousInfo:
        """`info` with the workers' store that this round's rank 0 posted (Note [the
        bootstrap store of a joining host]): an agent that cached an earlier round's store
        follows a rank 0 that is new to the job and serves a store of its own."""
        if info.rank == 0 or not self._inner.use_agent_store:
            return info
        addr = info.store.get(RendezvousStoreInfo.MASTER_ADDR_KEY).decode()
        port = int(info.store.get(RendezvousStoreInfo.MASTER_PORT_KEY).decode())
        boot = info.bootstrap_store_info
        if boot is not None and (boot.master_addr, int(boot.master_port)) == (addr, port):
            return info
        return RendezvousInfo(info.store, info.rank, info.world_size, RendezvousStoreInfo(addr, port))

    def _join(self, bound: float | None) -> RendezvousInfo:
        """The inner next_rendezvous, given up after `bound` seconds with a message naming
        the hosts that did not come (Note [a host that does not come back])."""
        if bound is None:
            return self._inner.next_rendezvous()
        box: dict[str, Any] = {}
        done = threading.Event()

        def run() -> None:
            try:
                box["info"] = self._inner.next_rendezvous()
            except BaseException as err:  # noqa: BLE001 - handed to the agent's thread
                box["err"] = err
            finally:
                done.set()

        threading.Thread(target=run, name="meshspeed-rendezvous", daemon=True).start()
        start = time.monotonic()
        told = start + min(NOTE_S, bound) / 2
        while not done.wait(0.5):
            waited = time.monotonic() - start
            if waited > bound:
                message = missing_message(self._missing(), (self._attempt or 0) + 1, waited)
                sys.stderr.write(message + "\n")
                sys.stderr.flush()
                raise RendezvousTimeoutError(message)
            if time.monotonic() > told:
                told += NOTE_S
                names = ", ".join(f"rank {r} on host {p.host}" for r, p in sorted(self._missing().items()))
                sys.stderr.write(f"meshspeed: host {self._host} waits up to {bound:.0f} s for "
                                 f"{names or 'the other hosts'} to join the next attempt\n")
                sys.stderr.flush()
        if "err" in box:
            raise box["err"]
        return box["info"]

    def _missing(self) -> dict[int, registry.Peer]:
        """Ranks of the last attempt whose host has not come back to the rendezvous."""
        back = set(self._arrived())
        return {r: p for r, p in self._registered().items() if p.host not in back}

    def _hosts_now(self) -> set[str]:
        """Hosts of the current attempt's ranks, from the registry."""
        name = f"round{self._attempt}"
        return {p.host for p in self._registered().values() if p.attempt == name}

    def _registered(self) -> dict[int, registry.Peer]:
        out = {}
        for rank in range(_MAX_RANKS):
            peer = registry.read(self._workers, rank) if self._workers is not None else None
            if peer is None:
                break
            out[rank] = peer
        return out

    def _arrived(self) -> list[str]:
        """Hosts that entered the rendezvous since the last round completed."""
        try:
            last = int(self._store.add(_ARRIVALS, 0))
            return [self._store.get(f"{_ARRIVALS}/{i}").decode()
                    for i in range(self._arrivals_seen + 1, last + 1)
                    if self._store.check([f"{_ARRIVALS}/{i}"])]
        except Exception:  # noqa: BLE001 - best effort
            return []

    def _connect(self, info: RendezvousInfo) -> Any:
        boot = info.bootstrap_store_info
        if boot is None or not self._inner.use_agent_store:
            return None
        try:
            return dist.TCPStore(boot.master_addr, int(boot.master_port), is_master=False,
                                 timeout=timedelta(seconds=3), wait_for_workers=False)
        except Exception:  # noqa: BLE001 - reports lose the registry, nothing else
            return None

    def _read_comms_timeout(self) -> float | None:
        try:
            if self._workers is not None and self._workers.check([registry.TIMEOUT_KEY]):
                return float(self._workers.get(registry.TIMEOUT_KEY))
        except Exception:  # noqa: BLE001, S110 - the workers' store went with its host
            pass
        return None
