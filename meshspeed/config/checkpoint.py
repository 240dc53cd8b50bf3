"""The `checkpoint` section. Owned by `meshspeed/checkpoint`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import model_validator

from meshspeed.config.base import CaseInsensitive, StrictModel


class CheckpointConfig(StrictModel):
    """How checkpoints are written and checked."""

    async_save: bool = False  # meshspeed: write in a background thread after snapshotting
    # meshspeed: load_checkpoint restores each rank's RNG states (dropout masks and data
    # order continue as if never interrupted); false keeps the current ones, as DeepSpeed does
    load_rng_state: bool = True
    # meshspeed (DeepSpeed has no such key): a restarted job continues from its newest
    # complete checkpoint by itself. With `dir`, initialize loads it; without, the script's
    # own `engine.load_checkpoint(dir)` does, and finds nothing to load on the first run
    # instead of failing (docs/failures.md, "Restarting after a failure").
    auto_resume: bool = False
    dir: str | None = None  # meshspeed: the directory the script saves to, read by auto_resume
    # What to do when ranks disagree on the checkpoint tag.
    tag_validation: CaseInsensitive("Ignore", "Warn", "Fail") = "Warn"  # type: ignore[valid-type]
    # the checkpoint to load is a DeepSpeed universal one (ds_to_universal): with no tag, the
    # tag `<dir>/latest_universal` names; a DeepSpeed tag that is not universal is an error
    # (Note [checkpoint.load_universal]); meshspeed's own checkpoints load as usual
    load_universal: bool = False
    # each host writes its ranks' files and the metadata under save_dir on its own disk
    # (Note [checkpoints on node-local disks] in checkpoint/hosts.py)
    use_node_local_storage: bool = False
    parallel_write: dict[str, Any] | None = None  # e.g. {"pipeline_stage": true}
    # meshspeed: "deepspeed" also writes DeepSpeed 0.19's files (mp_rank_00_model_states.pt,
    # zero_pp_rank_<r>_...) into each saved tag, for a DeepSpeed-readable trail; meshspeed
    # still loads its own files there (Note [a DeepSpeed trail in a meshspeed save])
    format: Literal["meshspeed", "deepspeed"] = "meshspeed"

    @model_validator(mode="after")
    def _dir_is_read_by_auto_resume(self):
        # a directory nobody reads would look like a resume that silently never happens
        if self.dir is not None and not self.auto_resume:
            raise ValueError("dir is read only by auto_resume (it names where a restarted job "
                             "resumes from); set auto_resume true or drop dir")
        if self.dir is not None and not self.dir.strip():
            raise ValueError("dir is empty; give the directory the script passes to "
                             "save_checkpoint, or drop the key")
        return self
