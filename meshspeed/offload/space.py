"""Room on the swap disks for the files a step writes, checked at initialize.

Note [room for the files the first step writes]
By the time the optimizer is built, initialize has written every 16-bit shard and fp32
master file. What is still to come: Adam's moment files (preallocated next, or written by
the first step with `fast_init`) and the gradient files (written by the first backward).
A disk that cannot hold them fails with ENOSPC in the middle of the first step, with a
half-written state; the check below fails in initialize instead, naming the path, what
is free on it, and what the ranks that share it still need. Ranks on one host may share
one file system (one `nvme_path`, or a list with fewer disks than ranks: Note [one disk
per rank] in swapdir.py), so each rank says what it still needs and on which file system
(host, device), and each file system's total is compared with its free space, measured
after every rank has written its shards and masters (the exchange is the barrier).
"""

from __future__ import annotations

import os
import shutil
import socket

from meshspeed import comm
from meshspeed.offload.grad_files import file_dtype
from meshspeed.offload.hostmem import round_up


def bytes_to_write(paths_and_sizes: list[tuple[str, int]]) -> int:
    """What the files still need beyond what they already hold (a file written before, e.g.
    by a load, counts what it has)."""
    return sum(max(0, n - (os.path.getsize(p) if os.path.exists(p) else 0)) for p, n in paths_and_sizes)


def planned_files(store) -> list[tuple[str, int]]:
    """(path, bytes) of the optimizer's moment files and the gradient files, as the first
    step leaves them (Note [room for the files the first step writes])."""
    out = [(store.path(sg, key), sg.nbytes) for sg in store.sub_groups
           if sg.index not in store.resident for key in store.rule.state_keys]
    grads = store.grads
    if grads is not None:
        for u, unit in enumerate(grads.masters.units):
            dtype = file_dtype(unit)
            out.append((grads.path(u), round_up(unit.shard_numel * dtype.itemsize)))
    return out


def check_swap_space(directory: str, need: int, key: str) -> list[str]:
    """Problems (empty when it fits) with `need` more bytes under `directory` on this rank,
    counted with the other ranks writing to the same file system."""
    dev = os.stat(directory).st_dev
    mine = (socket.gethostname(), dev)
    everyone = comm.all_gather_object((mine, need)) if comm.is_initialized() else [(mine, need)]
    sharing = [n for where, n in everyone if where == mine]
    total = sum(sharing)
    free = shutil.disk_usage(directory).free
    if total <= free:
        return []
    ranks = f"the {len(sharing)} ranks on this host that swap to it need" if len(sharing) > 1 else "this rank needs"
    return [(f"{key}: {directory} is on a file system with {free / 2**30:.2f} GiB free; {ranks} "
             f"{total / 2**30:.2f} GiB more for the optimizer's moment and gradient files "
             "the first step writes; free space there, point nvme_path at a larger disk, or give "
             "a list of paths, one per disk")]
