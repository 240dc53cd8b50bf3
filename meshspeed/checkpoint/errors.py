"""`CheckpointError`: every checkpoint failure, as one line naming the path and the fix."""

from __future__ import annotations

import errno


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved, found, verified or loaded.

    The message is a single line: what failed, the file or directory, and what to do."""


def describe_os_error(err: OSError, path: str, action: str) -> str:
    """One line for an OSError raised while `action`-ing `path` (e.g. action="write")."""
    if err.errno == errno.ENOSPC:
        return (f"cannot {action} {path}: no space left on device; free space on that "
                "filesystem or save to another directory (earlier checkpoints are untouched)")
    if err.errno == errno.EDQUOT:
        return f"cannot {action} {path}: disk quota exceeded; free space or raise the quota"
    if err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"cannot {action} {path}: permission denied ({err.strerror}); choose a writable directory"
    reason = err.strerror or str(err)
    return f"cannot {action} {path}: {reason} (errno {err.errno})"


# Note [DeepSpeed's exception types] (meshspeed/engine/errors.py): DeepSpeed asserts that
# the ranks agree on the tag and raises ValueError for a missing save_dir; these are
# CheckpointErrors that its callers catch as those types.
class TagMismatchError(CheckpointError, AssertionError):
    """The ranks passed different tags to save_checkpoint (checkpoint.tag_validation "FAIL")."""


class SaveDirError(CheckpointError, ValueError):
    """save_checkpoint got no directory (None or an empty path)."""
