"""`deepspeed.comm`: DeepSpeed's communication module, over meshspeed.comm (the collectives)
and meshspeed.process.distributed (starting and ending the process group).

Every name of meshspeed.comm is here too (`deepspeed.comm.all_reduce`, `get_rank`, ...);
what DeepSpeed adds is the process-group life cycle under its names."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from meshspeed import comm as _comm
from meshspeed.comm import *
from meshspeed.comm import __all__ as _collectives
from meshspeed.process.distributed import get_local_rank, init_distributed

__all__ = [*_collectives, "destroy_process_group", "get_local_rank", "init_distributed",  # noqa: PLE0604
           "new_group"]


def destroy_process_group(group: Any = None) -> None:
    """End the default process group (or `group`), as torch.distributed does."""
    if dist.is_initialized():
        dist.destroy_process_group(group)


def new_group(ranks: list[int] | None = None, **kwargs: Any) -> Any:
    """A process group of `ranks` (torch.distributed.new_group: every rank of the world calls
    it, in the same order, whether or not it is in `ranks`)."""
    return dist.new_group(ranks, **kwargs)


def __getattr__(name: str) -> Any:
    return getattr(_comm, name)
