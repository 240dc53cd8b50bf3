"""Offload sections: where ZeRO keeps optimizer state and parameters, and NVMe I/O.

Owned by `meshspeed/parallel/offload`.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, model_validator

from meshspeed.config.base import CaseInsensitive, NonNegInt, PositiveInt, StrictModel

Device = CaseInsensitive("none", "cpu", "nvme")


def path_for_rank(nvme_path: str | list[str], local_rank: int) -> str:
    """The directory local rank `local_rank` swaps under: the path, or `path[r % len]` of a
    list (Note [one disk per rank] in meshspeed/offload/swapdir.py)."""
    if isinstance(nvme_path, str):
        return nvme_path
    if not nvme_path:
        raise ValueError("nvme_path: an empty list names no directory; give one path, or one per disk")
    return str(nvme_path[local_rank % len(nvme_path)])


class _OffloadTarget(StrictModel):
    device: Device = "none"
    # directory on the NVMe device; required for "nvme". meshspeed also takes a list, one
    # directory per disk: local rank r swaps under path[r % len] (meshspeed/offload/swapdir.py)
    nvme_path: str | list[str] | None = None
    pin_memory: bool = False  # page-locked host buffers for async copies

    @model_validator(mode="after")
    def _nvme_needs_path(self):
        if isinstance(self.nvme_path, list) and not self.nvme_path:
            raise ValueError("nvme_path: an empty list names no directory; give one path, or one per disk")
        if self.device == "nvme" and not self.nvme_path:
            raise ValueError('nvme_path is required when device is "nvme"')
        if isinstance(self.nvme_path, list) and not all(self.nvme_path):
            raise ValueError(f"nvme_path: every directory of the list must be named (got {self.nvme_path!r})")
        return self


class OffloadOptimizerConfig(_OffloadTarget):
    """Keep optimizer state (and run the optimizer step) on CPU, or swap it to NVMe."""

    buffer_count: NonNegInt = 4  # NVMe swap buffers; at least the states per parameter
    fast_init: bool = False  # faster optimizer-state initialisation when on NVMe
    ratio: float = Field(1.0, ge=0.0, le=1.0)  # fraction of the step done on CPU
    # meshspeed: apply the CPU step one iteration late so it overlaps the next
    # forward/backward (ZeRO-Offload's "delayed parameter update", Ren et al. 2021).
    delayed_update: bool = False
    # meshspeed: elements of the first optimizer sub-groups whose fp32 masters and moments
    # stay in host memory with device "nvme" (offload_param.max_in_cpu's counterpart);
    # None: what MemAvailable leaves (Note [the residency budget] in offload/residency.py)
    max_in_cpu: NonNegInt | None = None
    # meshspeed: with device "nvme", update each sub-group during the boundary backward as
    # soon as its gradients are in their files, where the step would not change them first
    # (Note [the update during the backward] in offload/optimizer.py); false: at step()
    update_in_backward: bool = True
    # with update_in_backward: step() returns with the updates not done yet still running,
    # and the next forward waits for each unit's before gathering it (Note [the update that
    # runs into the next forward] in offload/optimizer.py); false: step() waits for them all
    update_into_forward: bool = True


class OffloadParamConfig(_OffloadTarget):
    """Keep ZeRO-3 parameter shards on CPU or NVMe between uses."""

    buffer_count: NonNegInt = 5  # NVMe read buffers
    buffer_size: NonNegInt = 100_000_000  # elements per NVMe buffer
    # elements of the first units' shards kept in CPU memory when on NVMe; unset (the 1e9
    # default is DeepSpeed's): what MemAvailable leaves (offload/residency.py)
    max_in_cpu: NonNegInt = 1_000_000_000


class AioConfig(StrictModel):
    """Asynchronous I/O settings for NVMe offload."""

    key_aliases: ClassVar[dict[str, str]] = {
        "intra_op_parallelism": "thread_count"
    }  # newer DeepSpeed name

    block_size: PositiveInt = 1_048_576  # bytes per I/O request
    queue_depth: PositiveInt = 8
    thread_count: PositiveInt = 1  # parallel threads per read/write
    single_submit: bool = False  # submit requests one by one instead of as a batch
    overlap_events: bool = True  # do not wait for earlier requests before submitting
