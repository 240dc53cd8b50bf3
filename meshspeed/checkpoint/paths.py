"""Where things live in a checkpoint directory, and finding the tag to load.

    <save_dir>/
      latest                     the newest complete tag (text), replaced atomically last
      <tag>/                     appears only when complete (renamed from <tag>.tmp-<nonce>/)
        meta.json                everything that is not a tensor (see metadata.py)
        rank-00000.safetensors   what global rank 0 owned: fp32 master ranges, optimizer
        rank-00001.safetensors   state ranges, RNG state (rank 0 also: persistent buffers)
        client_state.safetensors tensors found in client_state, if any
"""

from __future__ import annotations

import glob
import os

from meshspeed.checkpoint.errors import CheckpointError

LATEST = "latest"
META = "meta.json"
CLIENT_TENSORS = "client_state.safetensors"


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def rank_marker(rank: int) -> str:
    """Written (atomically) by a rank once its file is durable; rank 0 merges them."""
    return f"rank-{rank:05d}.json"


def rank_failure(rank: int) -> str:
    """Written instead of the marker when a rank's background write failed."""
    return f"rank-{rank:05d}.error.json"


def default_tag(global_steps: int) -> str:
    return f"global_step{global_steps}"


def check_tag(tag: str) -> str:
    tag = str(tag)
    bad = (not tag or tag in (".", "..", LATEST) or "/" in tag or os.sep in tag
           or ".tmp-" in tag or ".old-" in tag or tag.startswith("."))
    if bad:
        raise CheckpointError(f"invalid checkpoint tag {tag!r}: use a plain directory name "
                              "(no '/', not 'latest', not starting with '.')")
    return tag


def is_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, META))


def list_tags(save_dir: str) -> list[str]:
    """Complete checkpoints in `save_dir`, oldest first."""
    found = [d for d in glob.glob(os.path.join(glob.escape(save_dir), "*"))
             if is_checkpoint(d) and ".tmp-" not in d and ".old-" not in d]
    return [os.path.basename(d) for d in sorted(found, key=os.path.getmtime)]


def read_latest(save_dir: str) -> str | None:
    path = os.path.join(save_dir, LATEST)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return f.read().strip()


def _available(save_dir: str) -> str:
    tags = list_tags(save_dir)
    return f"available tags: {', '.join(tags)}" if tags else "the directory holds no complete checkpoint"


def resolve(load_dir: str | os.PathLike, tag: str | None) -> str:
    """The directory of the checkpoint to load, or a one-line CheckpointError saying why not.

    `load_dir` may also be a tag directory itself (it holds meta.json) when tag is None."""
    load_dir = os.fspath(load_dir)
    if not os.path.isdir(load_dir):
        raise CheckpointError(f"checkpoint directory {load_dir} does not exist; check the path "
                              "(it is the save_dir given to save_checkpoint)")
    if tag is None and is_checkpoint(load_dir):
        return load_dir
    from_latest = tag is None
    if tag is None:
        tag = read_latest(load_dir)
        if not tag:
            raise CheckpointError(f"no '{LATEST}' file in {load_dir} and no tag given; pass "
                                  f"tag=... ({_available(load_dir)})")
    try:  # the rules save applies: a tag is a plain name inside load_dir, never a path
        tag = check_tag(tag)
    except CheckpointError as err:
        if from_latest:
            raise CheckpointError(f"{os.path.join(load_dir, LATEST)} names {tag!r}, which is not a "
                                  f"checkpoint inside {load_dir}: a tag is a plain directory name "
                                  f"(no '/', not '..'); pass tag=... ({_available(load_dir)})") from None
        raise err from None
    path = os.path.join(load_dir, tag)
    if is_checkpoint(path):
        return path
    aside = glob.glob(glob.escape(path) + ".old-*")
    hint = f"; a previous copy was left at {aside[0]} by an interrupted save, rename it to {path}" \
        if aside else ""
    if os.path.isdir(path):
        raise CheckpointError(f"{path} has no {META}: it is not a complete meshspeed checkpoint; "
                              f"pass another tag ({_available(load_dir)}){hint}")
    if from_latest:
        raise CheckpointError(f"{os.path.join(load_dir, LATEST)} names {tag!r} but {path} does "
                              f"not exist (deleted or moved?); pass tag=... ({_available(load_dir)}){hint}")
    raise CheckpointError(f"no checkpoint {tag!r} in {load_dir}; {_available(load_dir)}{hint}")
