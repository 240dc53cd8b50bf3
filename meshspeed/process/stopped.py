"""When the launcher stops a rank, say why first: which peer died.

Note [naming the dead rank when torchrun stops the job]
Under torchrun, a rank that dies (killed, out of memory) is noticed by the launcher's
agent within its monitor interval (0.1 s), and the agent stops every other rank with
SIGTERM, then restarts the group (`--max-restarts`) or fails. A surviving rank is thus
killed before its own collective could fail and print the roll call (Note [roll call]):
by default SIGTERM ends a Python process without a word, and rank 0's output says nothing
of the dead peer. So under torchelastic, `init_distributed` installs a SIGTERM handler:
rank 0 writes one line naming the ranks on its host whose processes are gone (from the
pids the roll call posted at start), or on another host (posted there by that host's
ranks as they are stopped, and the heartbeat: Note [host registry and heartbeat] in
comm/registry.py), or the host whose joining made the agent restart the workers (a join,
not a death), and where rank 0 was, then re-raises SIGTERM with the
default action, so the exit status (-15) and torchrun's restart are as before. The
handler is Python's: it runs between bytecodes, so a rank inside a long C++ call reports
when the call returns; a collective with a dead peer returns at once (the connection
closes), and torchrun sends SIGKILL to whatever has not exited after its grace period.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from types import FrameType

import torch.distributed as dist

from meshspeed.comm import registry, rollcall

REMOTE_WAIT_S = 4.0  # how long rank 0 waits for another host's dead to be posted, or its beats to stop

_installed = False


_OURS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the meshspeed package
_TORCH = f"{os.sep}torch{os.sep}"


def _where(frame: FrameType | None) -> str:
    """The script's line the rank was at and, when different, the innermost meshspeed one."""
    inner = outer = None
    while frame is not None:
        name = os.path.abspath(frame.f_code.co_filename)
        here = f"{name}:{frame.f_lineno} in {frame.f_code.co_name}"
        if _TORCH not in name:
            inner = inner or here
            if not name.startswith(_OURS + os.sep) and outer is None:
                outer = here
        frame = frame.f_back
    if outer is None or inner is None or outer == inner:
        return outer or inner or "an unknown place"
    return f"{outer} (inside {inner})"


def stop_message(rank: int, world_size: int, where: str, wait_s: float = REMOTE_WAIT_S) -> str:
    """The line rank 0 writes when stopped (Note [naming the dead rank when torchrun stops the job])."""
    try:
        cause = _cause(rank, world_size, wait_s)
    except Exception:  # noqa: BLE001 - best effort: the stop goes on regardless
        cause = None
    if cause is not None and cause.startswith("host"):  # a join, not a failure
        return (f"meshspeed: rank {rank} stopped by the launcher (SIGTERM) at {where}: {cause}; "
                "it resumes from its newest complete checkpoint under checkpoint.auto_resume")
    cause = cause or ("no rank has died that this host can see (the job was stopped, or "
                      "another host's rank died without a word)")
    return (f"meshspeed: rank {rank} stopped by the launcher (SIGTERM) at {where}: {cause}; "
            "with --max-restarts the launcher restarts the job, which resumes from its newest "
            "complete checkpoint under checkpoint.auto_resume")


def _local_ranks(rank: int, world_size: int) -> range:
    # torchrun numbers a node's ranks contiguously: only this node's processes can be seen
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    first = max(rank - int(os.environ.get("LOCAL_RANK", "0")), 0)
    return range(first, min(first + local, world_size))


def _cause(rank: int, world_size: int, wait_s: float) -> str | None:
    """Why the launcher stops us: a host joined, ranks died (here, or on another host as its
    ranks posted, or its agent came back without them), ranks are unreachable (their
    heartbeat stopped: Note [host registry and heartbeat]), or None when nothing is known."""
    store = registry.root_store()
    joined = _read_list(store, registry.joining_key(registry.attempt()))
    if joined:
        return f"host {', '.join(joined)} joined; the job restarts at the new size"
    local = _local_ranks(rank, world_size)
    dead = dict(rollcall.dead_peers(local))
    others = [r for r in range(world_size) if r not in local]
    peers = {r: registry.read(store, r) for r in others}
    returned = set(_read_list(store, registry.returned_key(registry.attempt())))
    dead.update({r: -1 for r, p in peers.items() if p is not None and p.host in returned})
    deadline = time.monotonic() + wait_s
    while others and not dead:  # another host's ranks post its dead while stopping too
        dead.update({r: -1 for r in registry.posted_dead(store, others)})
        now = time.time()
        if dead or time.monotonic() > deadline or any(
                registry.peer_state(p, now) != "still computing" for p in peers.values() if p):
            break
        time.sleep(0.2)
        peers = {r: registry.read(store, r) for r in others}
    now = time.time()
    here = {r: registry.Peer(r, socket.gethostname(), pid, registry.attempt(), now)
            for r, pid in dead.items() if pid >= 0}
    lines = []
    for r in sorted(dead):
        peer = peers.get(r) or here.get(r)
        came_back = peer is not None and peer.host in returned
        state = f"died (host {peer.host} came back without it)" if came_back else "died"
        lines.append(registry.peer_line(peer, r, now, state))
    lines += [registry.peer_line(p, r, now) for r, p in peers.items()
              if p is not None and r not in dead and registry.peer_state(p, now) != "still computing"]
    if not lines:
        return None
    return ", ".join(lines) + " (see its own output and the launcher's report)"


def _read_list(store, key: str) -> list[str]:
    try:
        if store is not None and store.check([key]):
            return list(json.loads(store.get(key)))
    except Exception:  # noqa: BLE001, S110 - best effort
        pass
    return []


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    try:
        if dist.is_initialized():  # a sibling gone after this is stopped, not dead
            registry.post_stopped(None, dist.get_rank())
        if dist.is_initialized() and dist.get_rank() != 0:  # post this host's dead for rank 0
            rollcall.dead_peers(_local_ranks(dist.get_rank(), dist.get_world_size()))
        if dist.is_initialized() and dist.get_rank() == 0:
            sys.stderr.write(stop_message(0, dist.get_world_size(), _where(frame)) + "\n")
            sys.stderr.flush()
    finally:  # the default action: exit by the signal, as without this handler
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def install_stop_report(environ=os.environ) -> bool:
    """Install the SIGTERM report under torchelastic (torchrun), on the main thread, when
    no one else handles SIGTERM; True if installed."""
    global _installed
    if _installed:
        return True
    if "TORCHELASTIC_RUN_ID" not in environ or threading.current_thread() is not threading.main_thread():
        return False
    if signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None):
        return False  # the script (or a framework) has its own: leave it alone
    signal.signal(signal.SIGTERM, _on_sigterm)
    _installed = True
    return True
