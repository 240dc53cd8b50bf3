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


def new_group(ranks: list[int] | None = None, **kwargs: Any) -> Any:
    """A process group of `ranks` (every rank when None), as torch.distributed makes it:
    collective, every rank calls it for every group, in the same order."""
    return dist.new_group(ranks=ranks, **kwargs)


def destroy_process_group(group: Any = None) -> None:
    """End the default process group (or `group`), as torch.distributed does."""
    if dist.is_initialized():
        dist.destroy_process_group(group)


def __getattr__(name: str) -> Any:
    return getattr(_comm, name)
