"""All-or-nothing file system steps: temp name, fsync, rename.

A reader (or a crash) sees either the old file/directory or the complete new one, never a
part: content goes to a temporary name in the same directory, is fsynced, and is renamed
over the final name (rename is atomic within one file system); the parent directory is
then fsynced so that the rename itself survives a power loss.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from collections.abc import Callable
from typing import Any

from meshspeed.checkpoint.errors import CheckpointError, describe_os_error


def temp_name(path: str) -> str:
    return f"{path}.tmp-{os.getpid()}-{secrets.token_hex(3)}"


def fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some file systems (or platforms) cannot open directories
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_text(path: str, text: str) -> None:
    """Atomically replace `path` with `text`."""
    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)

    write_with(path, write)


def write_with(path: str, write: Callable[[str], None]) -> None:
    """Atomically replace `path` with what `write(temp_path)` writes (torch.save, safetensors'
    save_file, ...): concurrent writers of one path each publish a complete file. An OSError
    becomes a CheckpointError naming `path`; on any failure the temporary file is removed."""
    tmp = temp_name(path)
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        if os.path.exists(tmp):
            os.remove(tmp)
        if isinstance(err, OSError):
            raise CheckpointError(describe_os_error(err, path, "write")) from err
        raise
    fsync_dir(os.path.dirname(path) or ".")


def write_json(path: str, obj: Any) -> None:
    write_text(path, json.dumps(obj, separators=(",", ":")))


def read_json(path: str, what: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as err:
        raise CheckpointError(describe_os_error(err, path, "read")) from err
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path} ({what}) is not valid JSON ({err}); the file is corrupted "
                              "or truncated, load another tag") from None


def publish_dir(tmp: str, final: str) -> None:
    """Rename the complete directory `tmp` to `final`, replacing an older `final` if any.

    A directory cannot be renamed over a non-empty one, so an existing `final` is first
    moved aside and deleted after the new one is in place. (A crash in between leaves
    `<final>.old-*` holding the previous copy; the loader's error message points at it.)
    """
    parent = os.path.dirname(final) or "."
    aside = None
    try:
        fsync_dir(tmp)
        if os.path.exists(final):
            aside = f"{final}.old-{secrets.token_hex(3)}"
            os.rename(final, aside)
        os.rename(tmp, final)
        fsync_dir(parent)
    except OSError as err:
        raise CheckpointError(describe_os_error(err, final, "publish")) from err
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def remove_tree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
