"""Per-rank swap directories under `nvme_path`: checked at initialize, removed at exit.

Layout: `<nvme_path>/meshspeed-rank<r>-<pid>[-<n>]/<owner>/...`, one directory per rank
and process, so ranks sharing a disk (or a restarted job next to a crashed one) never
touch each other's files. The directory is removed when its `SwapDir` is garbage
collected or closed, and at interpreter exit (`weakref.finalize` runs at exit too);
a process killed with SIGKILL leaves it behind, and the name says which pid to look for.

Note [one disk per rank]
`nvme_path` may be a list of directories (a meshspeed extension: DeepSpeed takes one
path). Local rank r swaps under `nvme_path[r % len(nvme_path)]`, so with one directory
per disk and as many disks as ranks on a node, each rank's swap traffic has a disk of its
own; with fewer disks, ranks share them round-robin. Local rank, not global: the disks
belong to the node, and every node is assumed to mount the same list. A single string is
today's behaviour (every rank under it, each in its own directory). The choice is made
once, by `rank_path`, for every owner of swap files (zero.Init's chunk file, the 16-bit
shards, the masters, the moments, the gradient files); each directory of the list is
checked at initialize like a single path.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref

from meshspeed.config.errors import ConfigError
from meshspeed.config.offload import path_for_rank
from meshspeed.process.distributed import get_local_rank


def rank_path(nvme_path: str | list[str], local_rank: int | None = None) -> str:
    """The directory this rank (or `local_rank`) swaps under (Note [one disk per rank])."""
    if isinstance(nvme_path, os.PathLike):
        return os.fspath(nvme_path)
    try:
        return path_for_rank(nvme_path, get_local_rank() if local_rank is None else local_rank)
    except ValueError as err:
        raise ConfigError([str(err)]) from err


def check_nvme_path(path: str | list[str] | None, key: str) -> None:
    """Raise ConfigError unless `path` (or each directory of a list) is an existing,
    writable directory."""
    if isinstance(path, (list, tuple)) and path:
        problems = []
        for i, p in enumerate(path):
            try:
                check_nvme_path(p, f"{key}[{i}]")
            except ConfigError as err:
                problems.extend(err.problems)
        if problems:
            raise ConfigError(problems)
        return
    if not path:
        raise ConfigError([f"{key}: required when device is \"nvme\""])
    if not os.path.isdir(path):
        hint = "it does not exist" if not os.path.exists(path) else "it is not a directory"
        raise ConfigError([(f"{key}: {path!r} cannot hold swap files: {hint}; create it "
                           "(on a fast local disk) or point nvme_path elsewhere")])
    try:
        with tempfile.NamedTemporaryFile(dir=path, prefix=".meshspeed-probe-"):
            pass
    except OSError as err:
        raise ConfigError([f"{key}: {path!r} is not writable by this process ({err.strerror})"]) from err


class SwapDir:
    """This rank's private directory of swap files."""

    def __init__(self, nvme_path: str | list[str], rank: int):
        base = os.path.join(rank_path(nvme_path), f"meshspeed-rank{rank}-{os.getpid()}")
        path, n = base, 0
        while True:
            try:
                os.makedirs(path)
                break
            except FileExistsError:
                n += 1
                path = f"{base}-{n}"
        self.path = path
        self._finalizer = weakref.finalize(self, shutil.rmtree, path, True)

    def sub(self, name: str) -> str:
        """A subdirectory for one owner (optimizer state, parameter shards)."""
        p = os.path.join(self.path, name)
        os.makedirs(p, exist_ok=True)
        return p

    def file_bytes(self) -> int:
        """Bytes of all files under this directory, as the file system reports them."""
        total = 0
        for root, _, files in os.walk(self.path):
            for f in files:
                total += os.path.getsize(os.path.join(root, f))
        return total

    def close(self) -> None:
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive
