"""Rank functions for tests/checkpoint/test_node_local.py (module level, so they pickle)."""

from __future__ import annotations

import os

from meshspeed import comm
from tests.checkpoint import workers

LOCAL = {"checkpoint": {"use_node_local_storage": True}}


def resume_local(root: str, stage: int, n: int = 2, m: int = 2, async_save: bool = False) -> dict:
    """The key on one host: N steps, save, M steps == fresh engine, load, M steps."""
    extra = {"checkpoint": {"use_node_local_storage": True, "async_save": async_save}}
    setup = workers.setup_for(comm.get_world_size(), stage, steps=n + m, extra_config=extra)
    a = workers.make_engine(setup)
    workers.train(a, setup, 0, n)
    a.save_checkpoint(root, client_state={"t": 1})
    losses_a = workers.train(a, setup, n, n + m)
    b = workers.make_engine(setup, seed=7)
    path, client = b.load_checkpoint(root)
    return {"meta": _meta(path), "equal": losses_a == workers.train(b, setup, n, n + m), "path": path, "client": client,
            "files": sorted(os.listdir(path))}


def check_shared_with(tmp_of_rank: list[str], save_dir: str) -> str | None:
    """local_save.check_shared where each rank is given its own view of rank 0's directory."""
    from meshspeed.checkpoint import CheckpointError, local_save

    try:
        local_save.check_shared(tmp_of_rank[comm.get_rank()], save_dir)
    except CheckpointError as err:
        return str(err)
    return None


def full_disk_local(root: str, failing_rank: int) -> dict:
    """Node-local save of global_step1, then global_step2 with `failing_rank`'s disk full."""
    import errno

    from meshspeed.checkpoint import CheckpointError, tensorfile
    from meshspeed.checkpoint.paths import read_latest

    setup = workers.setup_for(comm.get_world_size(), 2, steps=3, extra_config=LOCAL)
    engine = workers.make_engine(setup)
    workers.train(engine, setup, 0, 1)
    engine.save_checkpoint(root)
    workers.train(engine, setup, 1, 2)

    def full(f, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    original = tensorfile._write_chunk
    if comm.get_rank() == failing_rank:
        tensorfile._write_chunk = full
    error = None
    try:
        engine.save_checkpoint(root)
    except CheckpointError as err:
        error = str(err)
    finally:
        tensorfile._write_chunk = original
    comm.barrier()
    return {"error": error, "latest": read_latest(root), "entries": sorted(os.listdir(root))}


def _meta(path: str) -> dict:
    import json

    with open(os.path.join(path, "meta.json"), encoding="utf-8") as f:
        return json.load(f)


def agree_on_resume(dir_of_rank: list[str]) -> tuple[str | None, str] | str:
    """resume._agree_across_hosts where each rank reads its own directory (its 'disk')."""
    from meshspeed.checkpoint import CheckpointError, resume

    mine = dir_of_rank[comm.get_rank()]
    tag, why = resume.newest_complete(mine)
    try:
        return resume._agree_across_hosts(mine, tag, why)
    except CheckpointError as err:
        return str(err)


def shared_disk_two_hostnames(root: str) -> dict:
    """The key on a directory that is shared after all (NFS) by two hosts: ranks 0-1 say
    they are 'hostA', ranks 2-3 'hostB'. Both hosts' first ranks make the temporary
    directory; the probes show one disk, so one publication: the usual checkpoint."""
    import socket

    name = "hostA" if comm.get_rank() < 2 else "hostB"
    original, socket.gethostname = socket.gethostname, lambda: name
    try:
        out = resume_local(root, 2)
    finally:
        socket.gethostname = original
    return out


def fetch_between(dirs: list[str], needed: list[list[str]]) -> dict:
    """fetch.fetch_missing with each rank a host of its own whose disk is dirs[rank]."""
    from meshspeed.checkpoint import CheckpointError
    from meshspeed.checkpoint.fetch import fetch_missing
    from meshspeed.checkpoint.hosts import Placement
    from meshspeed.checkpoint.metadata import read_meta

    rank = comm.get_rank()
    meta = read_meta(dirs[rank])
    placement = Placement(tuple(f"host{r}" for r in range(comm.get_world_size())))
    try:
        received = fetch_missing(dirs[rank], meta, set(needed[rank]), placement)
    except CheckpointError as err:
        return {"error": str(err), "files": sorted(os.listdir(dirs[rank]))}
    return {"error": None, "received": received, "files": sorted(os.listdir(dirs[rank]))}
