"""`save_checkpoint`: every rank writes what it owns; rank 0 publishes the directory.

Steps (collective): finish an asynchronous save in flight; agree on the tag; rank 0
creates `<tag>.tmp-<nonce>/`; every rank snapshots its state; then, either now or in a
background thread (`checkpoint.async_save`), every rank writes its file and marker and rank
0 publishes (Note [publishing a checkpoint] in writer.py). A failure on any rank raises on
all ranks and leaves `latest` and earlier checkpoints untouched. State in swap files is
always written before returning (Note [streaming swapped state] in snapshot.py). With
`checkpoint.use_node_local_storage` each disk's first rank does rank 0's part there (Note
[checkpoints on node-local disks] in hosts.py); without it, every rank first checks that it
sees rank 0's temporary directory (local_save.check_shared).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from meshspeed import comm
from meshspeed.checkpoint import local_save, pending
from meshspeed.checkpoint.agree import agree, everywhere, one_line, rank0_path
from meshspeed.checkpoint.errors import CheckpointError, SaveDirError, TagMismatchError
from meshspeed.checkpoint.paths import check_tag, default_tag
from meshspeed.checkpoint.snapshot import RankSnapshot, capture
from meshspeed.checkpoint.writer import (
    discard,
    prepare,
    publish,
    settle,
    wait_for_markers,
    write_failure,
    write_rank,
)

log = logging.getLogger("meshspeed")

# How long rank 0's background thread waits for the other ranks' files (asynchronous saves).
ASYNC_PUBLISH_TIMEOUT_S = float(os.environ.get("MESHSPEED_CHECKPOINT_ASYNC_TIMEOUT", "1800"))


def _agree_on_tag(engine, tag: str) -> None:
    tags = comm.all_gather_object(tag)
    if len(set(tags)) == 1:
        return
    policy = str(engine.config.checkpoint.tag_validation).lower()
    msg = f"ranks disagree on the checkpoint tag: {tags}; pass the same tag on every rank"
    if policy == "fail":
        raise TagMismatchError(msg)
    if policy == "warn" and comm.get_rank() == 0:
        log.warning("%s (saving under rank 0's tag %r)", msg, tags[0])


def _start(engine, save_dir: str, tag: str) -> str:
    """Collective: rank 0 creates the temporary directory; every rank learns its name and
    checks that it sees it (local_save.check_shared)."""
    tmp, error = None, None
    if comm.get_rank() == 0:
        try:
            tmp = prepare(save_dir, tag)
        except CheckpointError as err:
            error = str(err)
    tmp, error = comm.broadcast_object((tmp, error), src=0)
    if error:
        raise CheckpointError(error)
    local_save.check_shared(tmp, save_dir)
    return tmp


def _write_now(tmp: str, save_dir: str, tag: str, snap: RankSnapshot, save_latest: bool) -> str:
    error = None
    try:
        write_rank(tmp, snap)
    except Exception as err:  # noqa: BLE001 - reported on every rank
        error = err
    try:
        agree(error)
    except CheckpointError:
        if snap.rank == 0:
            discard(tmp)
        raise
    error = None
    if snap.rank == 0:
        try:
            markers = wait_for_markers(tmp, comm.get_world_size(), timeout=60.0)
            publish(tmp, save_dir, tag, snap.meta, markers, save_latest)
        except Exception as err:  # noqa: BLE001
            error = err
            discard(tmp)
    agree(error)  # also: no rank returns before the checkpoint is visible
    return os.path.join(save_dir, tag)


def _background_job(tmp: str, save_dir: str, tag: str, snap: RankSnapshot, world: int,
                    save_latest: bool):
    def job() -> None:
        try:
            write_rank(tmp, snap)
        except BaseException as err:
            write_failure(tmp, snap.rank, one_line(err))
            if snap.rank == 0:  # the others may still be writing into tmp
                settle(tmp, world, ASYNC_PUBLISH_TIMEOUT_S)
                discard(tmp)
            raise
        if snap.rank == 0:
            try:
                markers = wait_for_markers(tmp, world, ASYNC_PUBLISH_TIMEOUT_S)
                publish(tmp, save_dir, tag, snap.meta, markers, save_latest)
            except BaseException:
                settle(tmp, world, ASYNC_PUBLISH_TIMEOUT_S)
                discard(tmp)
                raise
    return job


_warned_sync = False
_warned_local = False


def _warn_sync_local(engine) -> None:
    """Node-local saves exchange every rank's file checksums by a collective, which a
    background thread may not call: they are written before save_checkpoint returns."""
    global _warned_local
    if engine.config.checkpoint.async_save and not _warned_local and comm.get_rank() == 0:
        log.warning("checkpoint.async_save with checkpoint.use_node_local_storage: checkpoints are "
                    "written before save_checkpoint returns (each host's meta.json needs every "
                    "rank's checksums, exchanged by a collective)")
        _warned_local = True


def _streams_anywhere(snap: RankSnapshot) -> bool:
    """Collective: whether some rank's snapshot reads swap files as it writes, so the save
    must be written now even with `async_save` (Note [streaming swapped state] in
    snapshot.py); warns once."""
    global _warned_sync
    streams = any(comm.all_gather_object(snap.streams))
    if streams and not _warned_sync and comm.get_rank() == 0:
        log.warning("checkpoint.async_save: the optimizer state or fp32 masters are in swap "
                    "files (offload nvme), so checkpoints are written before save_checkpoint "
                    "returns, streaming one tensor at a time (a background copy would hold "
                    "all of it in memory)")
        _warned_sync = True
    return streams


def save_checkpoint(engine, save_dir, tag=None, client_state: Any = None, save_latest: bool = True,
                    exclude_frozen: bool = False):
    """Save the full training state under `<save_dir>/<tag>/` (tag: `global_step<N>`);
    `exclude_frozen`: leave out parameters that do not require grad.

    Collective. Returns True, as DeepSpeed does. With `checkpoint.async_save` the files are
    written in the background; the next save, load, or exit waits for them."""
    if save_dir is None or os.fspath(save_dir) == "":
        raise SaveDirError(f"save_checkpoint needs a directory to save under, got save_dir={save_dir!r}; "
                           "pass a path (it is created if missing)")
    pending.wait_for_pending(engine)
    # Note [ranks that name different checkpoint directories] (agree.py)
    save_dir = rank0_path("checkpoint save directory", os.fspath(save_dir))
    tag = everywhere(check_tag, tag if tag is not None else default_tag(engine.global_steps))
    _agree_on_tag(engine, tag)
    tag = comm.broadcast_object(tag, src=0)
    gas = engine.config.gradient_accumulation_steps
    if engine.micro_steps % gas and comm.get_rank() == 0:
        log.warning("checkpoint %r is saved %d micro-step(s) into a gradient accumulation window "
                    "of %d: the partly accumulated gradients are not saved", tag,
                    engine.micro_steps % gas, gas)
    node_local = engine.config.checkpoint.use_node_local_storage
    if node_local:  # Note [checkpoints on node-local disks] in hosts.py
        local = local_save.start(save_dir, tag)
        tmp = local.tmp
    else:
        tmp = _start(engine, save_dir, tag)
    async_save = engine.config.checkpoint.async_save and not node_local
    try:
        snap = everywhere(capture, engine, tag, client_state, copy=async_save, exclude_frozen=exclude_frozen)
    except CheckpointError:
        if node_local:
            local.discard()
        elif comm.get_rank() == 0:
            discard(tmp)
        raise
    if node_local:
        _warn_sync_local(engine)
        local_save.write(local, save_dir, tag, snap, save_latest)
        return True
    if async_save and _streams_anywhere(snap):
        async_save = False  # the swap files must be read before training goes on
    if async_save:
        pending.start(engine, tag, _background_job(tmp, save_dir, tag, snap,
                                                   comm.get_world_size(), save_latest))
        return True
    _write_now(tmp, save_dir, tag, snap, save_latest)
    return True
