"""`deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine`: the checkpoint engine that
writes each file with `torch.save` and reads it with `torch.load`, synchronously."""

from __future__ import annotations

import logging
from typing import Any

import torch

from meshspeed.compat.deepspeed.runtime.checkpoint_engine.checkpoint_engine import (
    CheckpointCommitInfo,
    CheckpointEngine,
)

__all__ = ["TorchCheckpointEngine"]

log = logging.getLogger("meshspeed")


def _zipfile_serialization(config_params: Any) -> bool:
    """Whether to write torch's zip format: a DeepSpeed config object's
    `checkpoint_config["checkpoint_serialization"]` (the `checkpoint` section's key,
    default on); with no config, the legacy format, as DeepSpeed's writer does."""
    section = getattr(config_params, "checkpoint_config", None)
    if config_params is None or not isinstance(section, dict):
        return False
    return bool(section.get("checkpoint_serialization", True))


class TorchCheckpointEngine(CheckpointEngine):
    """`save(state, path)` is `torch.save`; `load(path, map_location)` is `torch.load` of
    full pickles (`weights_only=False`: the files hold optimizer and client state), so load
    only files you trust."""

    def __init__(self, config_params: Any = None):
        super().__init__(config_params)
        self.name = "TorchCheckpointEngine"
        self.zipfile_serialization = _zipfile_serialization(config_params)

    def create(self, info: CheckpointCommitInfo) -> None:
        log.debug("TorchCheckpointEngine: saving checkpoint %s in %s", info.tag, info.save_dir)

    def save(self, state_dict: Any, path: str) -> None:
        torch.save(state_dict, path, _use_new_zipfile_serialization=self.zipfile_serialization)

    def load(self, path: str, map_location: Any = None) -> Any:
        return torch.load(path, map_location=map_location, weights_only=False)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        return True  # every file was written by the time save() returned
