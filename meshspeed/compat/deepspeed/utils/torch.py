"""`deepspeed.utils.torch`: the torch-version check DeepSpeed's scripts and tests use."""

from __future__ import annotations

import torch

__all__ = ["required_torch_version"]


def required_torch_version(min_version: float | str | None = None, max_version: float | str | None = None) -> bool:
    """True when the running torch lies within [min_version, max_version] (either may be
    omitted, not both)."""
    if min_version is None and max_version is None:
        raise ValueError("required_torch_version needs min_version or max_version, e.g. min_version=2.1")
    running = _release(torch.__version__)
    if min_version is not None and _release(min_version) > running:
        return False
    return not (max_version is not None and _release(max_version) < running)


def _release(version: float | str) -> tuple[int, ...]:
    """(2, 13, 0) for "2.13.0+cpu" or "2.13.0a0"; (2, 1) for 2.1."""
    parts = []
    for piece in str(version).split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit()) if piece[:1].isdigit() else ""
        if not digits:
            break
        parts.append(int(digits[: len(piece) - len(piece.lstrip("0123456789"))] or digits))
    return tuple(parts)
