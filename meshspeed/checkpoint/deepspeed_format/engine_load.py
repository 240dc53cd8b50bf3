"""`engine.load_checkpoint(ds_dir)` for a DeepSpeed checkpoint directory.

Collective. Global rank 0 rewrites the DeepSpeed tag as a meshspeed checkpoint in a
temporary directory beside it (Note [importing through meshspeed's format]); every rank
then runs meshspeed's own loader on that, which reshards to the engine's layout, and the
temporary directory is removed whatever happened. A failure on any rank raises the same
CheckpointError on every rank.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable
from typing import Any

from meshspeed import comm
from meshspeed.checkpoint.agree import everywhere, one_line
from meshspeed.checkpoint.atomic import remove_tree
from meshspeed.checkpoint.deepspeed_format.discover import TagFiles
from meshspeed.checkpoint.deepspeed_format.kinds import open_tag
from meshspeed.checkpoint.deepspeed_format.to_meshspeed import write_meshspeed_tag
from meshspeed.checkpoint.errors import CheckpointError

log = logging.getLogger("meshspeed")

IMPORTED_TAG = "imported"


def _convert(files: TagFiles) -> str:
    """Rank 0: the temporary meshspeed copy of the tag; its root directory."""
    parent = os.path.dirname(os.path.abspath(files.path))
    try:
        root = tempfile.mkdtemp(prefix=".meshspeed-import-", dir=parent)
    except OSError as err:
        raise CheckpointError(f"cannot import the DeepSpeed checkpoint {files.path}: {parent} is not "
                              f"writable ({err.strerror}); meshspeed converts it there first, so every "
                              "rank can read the copy; make it writable, or convert it offline with "
                              "`meshspeed convert` into a meshspeed checkpoint") from None
    try:
        write_meshspeed_tag(open_tag(files), root, IMPORTED_TAG)
    except BaseException:
        remove_tree(root)
        raise
    return root


def _visible(root: str) -> None:
    if not os.path.isdir(os.path.join(root, IMPORTED_TAG)):
        raise CheckpointError(f"the converted copy {root} of the DeepSpeed checkpoint is not visible "
                              "on this rank; the checkpoint must be on a file system every rank shares")


def load_deepspeed(engine, files: TagFiles, load: Callable[..., tuple[str, Any]], **kwargs: Any) -> tuple[str, Any]:
    """Load the DeepSpeed tag `files` into `engine` through `load` (meshspeed's
    load_checkpoint) with its keyword arguments. Returns (the DeepSpeed tag directory,
    client_state)."""
    root, error = None, None
    if comm.get_rank() == 0:
        try:
            root = _convert(files)
        except Exception as err:  # noqa: BLE001 - reported on every rank
            error = one_line(err)
    root, error = comm.broadcast_object((root, error), src=0)
    if error:
        raise CheckpointError(error if comm.get_world_size() == 1 else f"rank 0: {error}")
    try:
        everywhere(_visible, root)
        _, client_state = load(engine, os.path.join(root, IMPORTED_TAG), None, **kwargs)
    finally:
        comm.barrier()  # every rank has read the copy (or failed with the others)
        if comm.get_rank() == 0:
            remove_tree(root)
    if comm.get_rank() == 0:
        log.info("loaded the DeepSpeed checkpoint %s", files.path)
    return files.path, client_state
