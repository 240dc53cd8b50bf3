"""When a collective fails, find out where every rank of its group is.

Note [roll call]
A timeout or a closed connection tells a rank only that it is waiting; which peer is
missing, and why, is known to the peers. On such a failure a rank posts where it is (op,
sequence number, group, call site) under its rank in the rendezvous store, which does not
depend on the broken group's connections, waits up to GRACE_S for its peers' records (not
for a peer on this host whose process is gone: it will never answer) and reads them:

* a peer waiting in the same collective (same group, same sequence number) has arrived;
* a peer in another collective is named with that collective;
* a peer that left posts when its process group is torn down (`post_exit`): it is named
  as exited after its last call on the group;
* a peer with no record did not answer: its host and pid, posted at start (`introduce`),
  tell on this host whether the process still runs (computing, or waiting outside any
  collective) or is gone (it died); on another host, the registry's heartbeat and the
  deaths its host's survivors posted tell the same (Note [host registry and heartbeat] in
  registry.py). Every line names the rank's host: `rank 3 on host node1 (process 812): died`.

Everything here is best effort and bounded: the store's timeout is lowered to STORE_S
first, and any failure of the store leaves the report out rather than hiding the error
being reported.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import time
from collections.abc import Iterable
from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d

from meshspeed.comm import registry

GRACE_S = 5.0  # how long a failing rank waits for its peers' records
_STILL_COMPUTING = f"still computing (no answer within {GRACE_S:.0f} s; or it waits outside any collective)"
STORE_S = 3.0
_PREFIX = "meshspeed/rollcall"


def _store() -> Any:
    try:
        store = distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no default group, or a backend without a store
        return None
    try:
        store.set_timeout(datetime.timedelta(seconds=STORE_S))
    except Exception:  # noqa: BLE001, S110
        pass
    return store


def _key(kind: str, rank: int) -> str:
    # the rendezvous store outlives the group across restarts: a key of this attempt must
    # not be read as a record of the previous one (Note [attempts every host agrees on])
    return f"{_PREFIX}/{registry.attempt()}/{kind}/{rank}"


def introduce() -> None:
    """Post this rank's host and pid (once per process group; cheap, at start). The store's
    own timeout is left as it was: the group's owner (maybe the caller) still uses it."""
    try:
        store = distributed_c10d._get_default_store()
        store.set(_key("who", dist.get_rank()),
                  json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
    except Exception:  # noqa: BLE001 - best effort (no default group, or no store)
        return
    registry.register(dist.get_rank())  # Note [host registry and heartbeat]


def post_exit(issued: dict[str, int]) -> None:
    """Post that this rank is leaving, with how many calls it issued on each group."""
    store = _store()
    if store is None:
        return
    try:
        store.set(_key("at", dist.get_rank()), json.dumps({"state": "exited", "issued": issued}))
    except Exception:  # noqa: BLE001, S110 - best effort
        pass


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")  # a zombie has exited; its parent has not reaped it
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def _read(store: Any, key: str) -> dict | None:
    try:
        if store.check([key]):
            return json.loads(store.get(key))
    except Exception:  # noqa: BLE001, S110 - best effort
        pass
    return None


def report(op: str, group_ranks: list[int], seq: int, site: str) -> str:
    """Post where this rank waits, gather where its peers are; a few lines for the error
    (empty when the store cannot be reached)."""
    store = _store()
    if store is None:
        return ""
    me = dist.get_rank()
    group = ",".join(map(str, group_ranks))
    mine = {"state": "waiting", "op": op, "seq": seq, "group": group, "site": site}
    try:
        store.set(_key("at", me), json.dumps(mine))
    except Exception:  # noqa: BLE001 - the store is gone too (its host died)
        return ""
    peers = [r for r in group_ranks if r != me]
    records: dict[int, dict] = {}
    deadline = time.monotonic() + GRACE_S
    while True:
        for r in peers:
            rec = _read(store, _key("at", r))
            if rec is not None and (rec.get("state") == "exited" or rec.get("group") != group
                                    or rec.get("seq") >= seq):
                records[r] = rec
        # a peer whose process is gone will never answer: no need to wait the grace out
        waiting = [r for r in peers if r not in records]
        dead = {r for r, _ in dead_peers(waiting)} | set(registry.posted_dead(store, waiting))
        if len(records) + len(dead) == len(peers) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    lines, missing, hosts = [], [], {}
    for r in peers:
        line, arrived = _describe(store, r, records.get(r), group, seq)
        lines.append(f"  {line}")
        if not arrived:
            missing.append(r)
            peer = registry.read(store, r)
            if peer is not None:
                hosts.setdefault(peer.host, []).append(r)
    on = "; ".join(f"host {h}: {', '.join(map(str, rs))}" for h, rs in hosts.items())
    head = (f"ranks that have not arrived in {op} #{seq}: {missing}" + (f" ({on})" if on else "")
            if missing else f"every rank of the group is waiting in {op} #{seq}")
    return head + "\n" + "\n".join(lines)


def _describe(store: Any, rank: int, rec: dict | None, group: str, seq: int) -> tuple[str, bool]:
    """("rank R on host H (process P): what it is doing", whether it has arrived)."""
    peer = registry.read(store, rank)
    who = _read(store, _key("who", rank))
    if peer is None and who is not None:  # registered in this attempt, but no heartbeat record
        peer = registry.Peer(rank, who["host"], int(who["pid"]), registry.attempt(), time.time())
    if rec is not None and rec.get("state") == "exited":
        last = rec.get("issued", {}).get(group)
        after = "" if last is None else f" after {last} call(s) on this group (this rank is at call #{seq})"
        state = f"exited{after}: its process group was shut down, it left the loop early"
        return registry.peer_line(peer, rank, time.time(), state), False
    if rec is not None and rec.get("group") == group and rec.get("seq") == seq:
        state = f"waiting in the same {rec['op']} #{seq} (called at {rec['site']})"
        return registry.peer_line(peer, rank, time.time(), state), True
    if rec is not None:
        state = f"waiting in {rec['op']} #{rec['seq']} on group [{rec['group']}] (called at {rec['site']})"
        return registry.peer_line(peer, rank, time.time(), state), False
    if peer is None:
        return registry.peer_line(None, rank, time.time(), f"did not answer within {GRACE_S:.0f} s: "
                                  "it died, or is in no collective"), False
    if peer.host != socket.gethostname():  # another host: its heartbeat and its survivors tell
        state = registry.peer_state(peer, time.time())
        if state == "still computing":
            state = _STILL_COMPUTING
        return registry.peer_line(peer, rank, time.time(), state), False
    if _alive(peer.pid):
        return registry.peer_line(peer, rank, time.time(), _STILL_COMPUTING), False
    if registry.was_stopped(store, rank):
        return registry.peer_line(peer, rank, time.time(), "stopped by its launcher (SIGTERM)"), False
    registry.post_dead(store, rank, peer.pid)
    return registry.peer_line(peer, rank, time.time(), "died (its process is gone; see its own output)"), False


def dead_peers(ranks: Iterable[int]) -> list[tuple[int, int]]:
    """(rank, pid) of each of `ranks` on this host whose process is gone, from the records
    of `introduce`; bounded and best effort like the rest of the roll call ([] without a store)."""
    store = _store()
    if store is None:
        return []
    host, me, dead = socket.gethostname(), dist.get_rank(), []
    for rank in ranks:
        who = _read(store, _key("who", rank)) if rank != me else None
        if (who is not None and who.get("host") == host and not _alive(int(who["pid"]))
                and not registry.was_stopped(store, rank)):  # stopped by its launcher: not dead
            dead.append((rank, int(who["pid"])))
            registry.post_dead(store, rank, int(who["pid"]))  # for the other hosts' reports
    return dead
