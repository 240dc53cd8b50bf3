"""`deepspeed.runtime.checkpoint_engine.checkpoint_engine`: the interface of a checkpoint
file writer (`CheckpointEngine`) and what a finished save tells it (`CheckpointCommitInfo`)."""

from __future__ import annotations

import abc
import os
from dataclasses import dataclass
from typing import Any

__all__ = ["CheckpointCommitInfo", "CheckpointEngine"]


@dataclass
class CheckpointCommitInfo:
    """The save a writer is told about: its tag, directory and whether `latest` moves."""

    tag: str
    save_dir: str
    save_latest: bool


class CheckpointEngine(abc.ABC):
    """Writes and reads the files of a save: `create` before the first file, `save`/`load`
    per file, `commit` once every file is written (True: the save is durable)."""

    def __init__(self, config_params: Any = None):
        self.name: str | None = None

    @abc.abstractmethod
    def create(self, info: CheckpointCommitInfo) -> None: ...

    @abc.abstractmethod
    def save(self, state_dict: Any, path: str) -> None: ...

    @abc.abstractmethod
    def load(self, path: str, map_location: Any = None) -> Any: ...

    @abc.abstractmethod
    def commit(self, info: CheckpointCommitInfo) -> bool: ...

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        os.makedirs(path, exist_ok=exist_ok)

    def is_data_parallel_writer(self, dp_rank: int) -> bool:
        """Whether the rank at this data-parallel index writes the replicated files."""
        return dp_rank == 0

    def is_decoupled(self) -> bool:
        """Whether saves finish in the background (this interface's writers: no)."""
        return False

    def set_commit_info(self, info: CheckpointCommitInfo) -> None:
        """Told before a decoupled save's files; a synchronous writer needs nothing."""

    def get_commit_info(self) -> CheckpointCommitInfo | None:
        return None

    def cleanup(self) -> None:
        """Release what the writer holds (threads, handles); a synchronous writer holds nothing."""

    def preserves_storage_sharing(self) -> bool:
        """Whether tensors sharing a storage are written once (torch.save: yes)."""
        return True
