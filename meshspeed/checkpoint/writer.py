"""Writing a checkpoint directory: per-rank files, markers, and publishing by rank 0.

Note [publishing a checkpoint]
Every rank writes into `<tag>.tmp-<nonce>/`: its tensor file (temp name, fsync, rename),
then a small marker `rank-XXXXX.json` holding the file's size and SHA-256. Global rank 0
waits for all markers, writes meta.json, renames the directory to `<tag>/` and only then
replaces `latest`. A crash at any point before that rename leaves only a `.tmp-` directory
(ignored by loaders, removed by the next save of that tag), so `latest` always names a
complete checkpoint. Markers are files rather than a collective so that the same code
serves asynchronous saves, whose background threads must not call collectives. On
node-local disks every disk is published this way by its own first rank (`seal`, then
`finish` once every disk is sealed: local_save.py).
"""

from __future__ import annotations

import glob
import logging
import os
import secrets
import threading
import time

import torch

from meshspeed.checkpoint.atomic import publish_dir, read_json, remove_tree, write_json, write_text
from meshspeed.checkpoint.errors import CheckpointError, describe_os_error
from meshspeed.checkpoint.metadata import check_coverage, merge_rank
from meshspeed.checkpoint.paths import (
    CLIENT_TENSORS,
    LATEST,
    META,
    rank_failure,
    rank_file,
    rank_marker,
)
from meshspeed.checkpoint.snapshot import RankSnapshot
from meshspeed.checkpoint.tensorfile import Spec, TensorFileWriter, write_tensors
from meshspeed.parallel.slices import Deferred
from meshspeed.process.progress import progress

log = logging.getLogger("meshspeed")


def _test_pause(point: str) -> None:
    """Called at named points of a save; tests replace it to freeze a rank there."""


def temp_dir(save_dir: str, tag: str) -> str:
    return f"{os.path.join(save_dir, tag)}.tmp-{secrets.token_hex(4)}"


def prepare(save_dir: str, tag: str, tmp: str | None = None) -> str:
    """Rank 0 (or each disk's first rank, Note [checkpoints on node-local disks] in
    hosts.py): create the temporary directory of this save, `tmp` if given (it may exist
    already: another host on the same disk made it), clearing stale ones of the tag."""
    final = os.path.join(save_dir, tag)
    try:
        os.makedirs(save_dir, exist_ok=True)
        for stale in glob.glob(glob.escape(final) + ".tmp-*"):
            if stale != tmp:
                remove_tree(stale)  # left by an interrupted save of the same tag
        if tmp is None:
            tmp = temp_dir(save_dir, tag)
            os.makedirs(tmp)
        else:
            os.makedirs(tmp, exist_ok=True)
    except OSError as err:
        raise CheckpointError(describe_os_error(err, save_dir, "create a checkpoint in")) from err
    return tmp


def stream_tensors(path: str, tensors: dict[str, torch.Tensor | Deferred]) -> tuple[int, str]:
    """`write_tensors`, reading each Deferred right before writing it and dropping it after
    (Note [streaming swapped state] in snapshot.py); returns (file size, sha256)."""
    specs = [Spec(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]
    # an asynchronous save's thread reports nothing: the training loop owns the output
    foreground = threading.current_thread() is threading.main_thread()
    with TensorFileWriter(path, specs) as w, progress(len(specs) if foreground else 0, "checkpoint save",
                                                      unit="tensor") as bar:
        for name, t in tensors.items():
            w.write(name, t.read() if isinstance(t, Deferred) else t)
            bar.update()
    return w.nbytes, w.sha256


def write_rank(tmp: str, snap: RankSnapshot) -> dict:
    """This rank's tensor file, then its marker (the marker says the file is durable);
    returns the marker's content."""
    nbytes, sha = stream_tensors(os.path.join(tmp, rank_file(snap.rank)), snap.tensors)
    if snap.client_tensors:
        cb, csha = write_tensors(os.path.join(tmp, CLIENT_TENSORS), snap.client_tensors)
        snap.meta["files"][CLIENT_TENSORS] = {"bytes": cb, "sha256": csha}
    _test_pause("rank_file_written")
    marker = {**snap.info, "bytes": nbytes, "sha256": sha}
    write_json(os.path.join(tmp, rank_marker(snap.rank)), marker)
    return marker


def write_failure(tmp: str, rank: int, message: str) -> None:
    """Best effort: tell rank 0 (waiting for markers) that this rank will not finish."""
    try:
        write_json(os.path.join(tmp, rank_failure(rank)), {"rank": rank, "error": message})
    except CheckpointError:
        pass


def read_markers(tmp: str, world: int) -> list[dict]:
    return [read_json(os.path.join(tmp, rank_marker(r)), "rank marker") for r in range(world)]


def wait_for_markers(tmp: str, world: int, timeout: float) -> list[dict]:
    """Poll until every rank's marker exists; raise on a failure marker or the timeout."""
    deadline = time.monotonic() + timeout
    delay = 0.01
    while True:
        missing = [r for r in range(world) if not os.path.exists(os.path.join(tmp, rank_marker(r)))]
        for r in missing:
            failed = os.path.join(tmp, rank_failure(r))
            if os.path.exists(failed):
                raise CheckpointError(f"rank {r}: {read_json(failed, 'failure marker')['error']}")
        if not missing:
            return read_markers(tmp, world)
        if time.monotonic() > deadline:
            raise CheckpointError(f"rank(s) {missing} did not finish writing {tmp} within "
                                  f"{timeout:.0f} s; the checkpoint was not published")
        time.sleep(delay)
        delay = min(delay * 2, 0.5)


def settle(tmp: str, world: int, timeout: float) -> None:
    """Poll until every rank has left a marker or a failure marker in `tmp` (or `timeout`
    passed): after a failure, rank 0 waits for the others to stop writing before it
    removes the directory under them."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(os.path.exists(os.path.join(tmp, rank_marker(r)))
               or os.path.exists(os.path.join(tmp, rank_failure(r))) for r in range(world)):
            return
        time.sleep(0.05)


def discard(tmp: str) -> None:
    """Remove the temporary directory of a failed save; if that fails too, say where it is."""
    remove_tree(tmp)
    if os.path.exists(tmp):
        log.warning("meshspeed: could not remove %s, left by a failed checkpoint save; it is not "
                    "a checkpoint (load never reads it) and the next save of this tag removes it", tmp)


def seal(tmp: str, meta: dict, markers: list[dict]) -> None:
    """meta.json into `tmp`, markers removed: the directory is ready to be renamed."""
    for info in sorted(markers, key=lambda m: m["rank"]):
        merge_rank(meta, info)
    check_coverage(meta)
    write_json(os.path.join(tmp, META), meta)
    for r in range(len(markers)):
        marker = os.path.join(tmp, rank_marker(r))
        if os.path.exists(marker):  # node-local: only this disk's ranks' markers are here
            os.remove(marker)
    if (meta.get("config") or {}).get("checkpoint", {}).get("format") == "deepspeed":
        if not all(os.path.isfile(os.path.join(tmp, name)) for name in meta["files"]):
            log.warning("meshspeed: checkpoint.format 'deepspeed': no DeepSpeed trail in %s, which "
                        "holds only this host's files (use_node_local_storage)", tmp)
            return
        # Note [a DeepSpeed trail in a meshspeed save]
        # lazy: the exporter imports this module (prepare()); a top-level import is a cycle
        from meshspeed.checkpoint.deepspeed_format.trail import write_trail

        write_trail(tmp, meta)


def finish(tmp: str, save_dir: str, tag: str, save_latest: bool) -> str:
    """Rename the sealed `tmp` to <tag>/, then replace `latest`."""
    final = os.path.join(save_dir, tag)
    _test_pause("before_publish")
    publish_dir(tmp, final)
    if save_latest:
        write_text(os.path.join(save_dir, LATEST), tag)
    return final


def publish(tmp: str, save_dir: str, tag: str, meta: dict, markers: list[dict],
            save_latest: bool) -> str:
    """Rank 0: meta.json, rename to <tag>/, then `latest` (see Note [publishing a checkpoint])."""
    seal(tmp, meta, markers)
    return finish(tmp, save_dir, tag, save_latest)
