"""DeepSpeed-compatible helpers that scripts reach as `deepspeed.utils.X`."""

from __future__ import annotations

import logging

from meshspeed import comm
from meshspeed.data.loader import RepeatingLoader

logger = logging.getLogger("meshspeed")

__all__ = ["RepeatingLoader", "log_dist", "logger"]


def log_dist(message: str, ranks: list[int] | None = None, level: int = logging.INFO) -> None:
    """Log `message` on the listed ranks (default: rank 0; [-1]: every rank)."""

    rank = comm.get_rank() if comm.is_initialized() else 0
    ranks = [0] if ranks is None else ranks
    if -1 in ranks or rank in ranks:
        logger.log(level, "[rank %d] %s", rank, message)


# DeepSpeed's per-parameter access helpers (deepspeed.utils.safe_get_full_fp32_param, ...)
from meshspeed.parallel.access import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_get_local_fp32_param,
    safe_get_local_grad,
    safe_get_local_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_grad,
    safe_set_full_optimizer_state,
    safe_set_local_fp32_param,
    safe_set_local_grad,
    safe_set_local_optimizer_state,
)

__all__ += ["safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
            "safe_get_local_fp32_param", "safe_get_local_grad", "safe_get_local_optimizer_state",
            "safe_set_full_fp32_param", "safe_set_full_grad", "safe_set_full_optimizer_state",
            "safe_set_local_fp32_param", "safe_set_local_grad", "safe_set_local_optimizer_state"]
