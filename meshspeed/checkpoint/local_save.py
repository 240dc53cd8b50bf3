"""Saving when ranks may not share the checkpoint directory.

Two jobs, both collective and both cheap (a few small all-gathers per save):

* `check_shared`: without `checkpoint.use_node_local_storage`, every rank checks that it
  sees the temporary directory rank 0 just made, before any tensor is written. A rank that
  does not is on another disk: the save fails there and then, in one sentence naming the
  ranks, their hosts and the key, instead of a "No such file or directory" from a
  temporary path half-way through the write.
* `start` / `write`: with the key, Note [checkpoints on node-local disks] in hosts.py.
"""

from __future__ import annotations

import logging
import os
import socket
import time

from meshspeed import comm
from meshspeed.checkpoint.agree import agree
from meshspeed.checkpoint.errors import CheckpointError
from meshspeed.checkpoint.hosts import (
    Placement,
    gather_placement,
    leave_probe,
    probes_seen,
    remove_probes,
    storage_groups,
)
from meshspeed.checkpoint.snapshot import RankSnapshot
from meshspeed.checkpoint.writer import discard, finish, prepare, seal, temp_dir, write_rank

log = logging.getLogger("meshspeed")

KEY = "checkpoint.use_node_local_storage"


def _sees(path: str, patience: float = 1.0) -> bool:
    """Whether this rank sees directory `path`; a network file system may show a directory
    another client just made a little later, so a miss is looked at again for `patience` s."""
    deadline = time.monotonic() + patience
    while True:
        try:
            os.listdir(os.path.dirname(path) or ".")  # refreshes a cached listing (NFS)
        except OSError:
            pass
        if os.path.isdir(path):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def _see(ranks: list[int]) -> str:
    return "does not see" if len(ranks) == 1 else "do not see"


def check_shared(tmp: str, save_dir: str) -> None:
    """Collective: raise on every rank unless every rank sees rank 0's `tmp` (rank 0 then
    removes it)."""
    seen = comm.all_gather_object((_sees(tmp), socket.gethostname()))
    blind = [r for r, (sees, _) in enumerate(seen) if not sees]
    if not blind:
        return
    if comm.get_rank() == 0:
        discard(tmp)
    where = Placement(tuple(h for _, h in seen))
    raise CheckpointError(
        f"{where.describe(blind)} {_see(blind)} the checkpoint directory {save_dir} that rank 0 "
        f"(on {where.hostnames[0]}) writes to, so the ranks do not share this directory: set "
        f"{KEY}: true to write each host's part on its own disk, or save under a file system "
        "every host mounts")


class LocalSave:
    """One save on node-local disks: the temporary directory and the group of ranks that
    share this rank's disk (its lowest rank publishes there)."""

    def __init__(self, tmp: str, group: list[int], placement: Placement):
        self.tmp = tmp
        self.group = group
        self.placement = placement

    @property
    def publisher(self) -> bool:
        return comm.get_rank() == self.group[0]

    def discard(self) -> None:
        if self.publisher:
            discard(self.tmp)


def start(save_dir: str, tag: str) -> LocalSave:
    """Collective: every host's first rank creates the temporary directory (one name,
    chosen by rank 0) on its disk and leaves a probe; ranks that see the same probes share a
    disk (Note [checkpoints on node-local disks])."""
    placement = gather_placement()
    rank = comm.get_rank()
    tmp = comm.broadcast_object(temp_dir(save_dir, tag) if rank == 0 else None, src=0)
    error, leader = None, placement.leader(rank) == rank
    if leader:
        try:
            prepare(save_dir, tag, tmp)
            leave_probe(tmp, rank)
        except (CheckpointError, OSError) as err:
            error = err
    try:
        agree(error)
    except CheckpointError:
        if leader:
            discard(tmp)
        raise
    seen = comm.all_gather_object(probes_seen(tmp))
    groups = storage_groups(seen)
    blind = [r for r, probes in enumerate(seen) if not probes]
    if blind:  # ranks of one hostname on different disks
        save = LocalSave(tmp, next(g for g in groups if rank in g), placement)
        if seen[rank]:
            save.discard()
        raise CheckpointError(
            f"{placement.describe(blind)} {_see(blind)} the checkpoint directory {save_dir} that "
            f"the first rank of their host made, though {KEY} is set: ranks with one hostname "
            "must share a disk; check that each host has one hostname and one disk at this path")
    return LocalSave(tmp, next(g for g in groups if rank in g), placement)


def write(save: LocalSave, save_dir: str, tag: str, snap: RankSnapshot, save_latest: bool) -> str:
    """Collective: every rank writes its file on its disk; every disk's publisher seals the
    same meta.json there (all ranks' markers travel by an all-gather), then renames; a
    failure anywhere raises everywhere, with no disk's `latest` moved on before every disk
    is sealed."""
    error, marker = None, None
    try:
        marker = write_rank(save.tmp, snap)
    except Exception as err:  # noqa: BLE001 - reported on every rank
        error = err
    _settle(save, error)
    markers = comm.all_gather_object(marker)
    meta = comm.broadcast_object(snap.meta, src=0)
    meta["storage"] = {"node_local": True, "hosts": list(save.placement.hostnames)}
    if save.publisher:
        try:
            remove_probes(save.tmp)
            seal(save.tmp, meta, markers)
        except Exception as err:  # noqa: BLE001
            error = err
    _settle(save, error)
    if save.publisher:
        try:
            finish(save.tmp, save_dir, tag, save_latest)
        except Exception as err:  # noqa: BLE001
            error = err
            save.discard()
    agree(error)
    return os.path.join(save_dir, tag)


def _settle(save: LocalSave, error: BaseException | None) -> None:
    try:
        agree(error)
    except CheckpointError:
        save.discard()
        raise
