"""When the launcher stops a rank, say why first: which peer died.

Note [naming the dead rank when torchrun stops the job]
Under torchrun, a rank that dies (killed, out of memory) is noticed by the launcher's
agent within its monitor interval (0.1 s), and the agent stops every other rank with
SIGTERM, then restarts the group (`--max-restarts`) or fails. A surviving rank is thus
killed before its own collective could fail and print the roll call (Note [roll call]):
by default SIGTERM ends a Python process without a word, and rank 0's output says nothing
of the dead peer. So under torchelastic, `init_distributed` installs a SIGTERM handler:
rank 0 writes one line naming the ranks on its host whose processes are gone (from the
pids the roll call posted at start) and where rank 0 was, then re-raises SIGTERM with the
default action, so the exit status (-15) and torchrun's restart are as before. The
handler is Python's: it runs between bytecodes, so a rank inside a long C++ call reports
when the call returns; a collective with a dead peer returns at once (the connection
closes), and torchrun sends SIGKILL to whatever has not exited after its grace period.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType

import torch.distributed as dist

from meshspeed.comm import rollcall

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


def stop_message(rank: int, world_size: int, where: str) -> str:
    """The line rank 0 writes when stopped (Note [naming the dead rank when torchrun stops the job])."""
    # torchrun numbers a node's ranks contiguously: only this node's can be seen to be gone,
    # and a store read per rank of a large job would hold up the stop
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    first = rank - int(os.environ.get("LOCAL_RANK", "0"))
    try:
        dead = rollcall.dead_peers(range(max(first, 0), min(first + local, world_size)))
    except Exception:  # noqa: BLE001 - best effort: the stop goes on regardless
        dead = []
    if dead:
        names = ", ".join(f"rank {r} (process {pid})" for r, pid in dead)
        cause = f"{names} died (see its own output and the launcher's report)"
    else:
        cause = "no rank on this host has died (another host's, or the job was stopped)"
    return (f"meshspeed: rank {rank} stopped by the launcher (SIGTERM) at {where}: {cause}; "
            "with --max-restarts the launcher restarts the job, which resumes from its newest "
            "complete checkpoint under checkpoint.auto_resume")


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    try:
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
