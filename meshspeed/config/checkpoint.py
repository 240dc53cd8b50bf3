"""The `checkpoint` section. Owned by `meshspeed/checkpoint`."""

from __future__ import annotations

from typing import Any

from meshspeed.config.base import CaseInsensitive, StrictModel


class CheckpointConfig(StrictModel):
    """How checkpoints are written and checked."""

    async_save: bool = False  # meshspeed: write in a background thread after snapshotting
    # meshspeed: load_checkpoint restores each rank's RNG states (dropout masks and data
    # order continue as if never interrupted); false keeps the current ones, as DeepSpeed does
    load_rng_state: bool = True
    # What to do when ranks disagree on the checkpoint tag.
    tag_validation: CaseInsensitive("Ignore", "Warn", "Fail") = "Warn"  # type: ignore[valid-type]
    load_universal: bool = False  # load a universal (topology-free) checkpoint
    use_node_local_storage: bool = False  # each node writes to its own disk
    parallel_write: dict[str, Any] | None = None  # e.g. {"pipeline_stage": true}
