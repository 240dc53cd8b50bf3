"""A training corpus every machine already has: the Python standard library's source.

Byte-level language modelling on it needs no download and no tokenizer, and its text is
varied enough that a small model's loss falls visibly below the unigram entropy.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import torch

# Directory names skipped anywhere under the stdlib root. Test suites are huge and
# repetitive (and contain deliberately malformed files); third-party packages differ
# from machine to machine; `config-*` holds one platform-specific script.
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}


def _stdlib_sources(root: Path) -> list[Path]:
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune in place so os.walk never descends into skipped trees.
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("config-")]
        for name in filenames:
            # _sysconfigdata_*.py records this interpreter's build paths: machine-specific.
            if name.endswith(".py") and not name.startswith("_sysconfigdata"):
                files.append(Path(dirpath, name))
    # Sort on the path relative to the root so the order is the same wherever Python is
    # installed, and independent of the filesystem's listing order.
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def stdlib_corpus(max_bytes: int | None = None) -> bytes:
    """The standard library's `.py` files concatenated in sorted path order.

    Deterministic for a given Python version; test directories and site-packages are
    excluded. Reading stops once `max_bytes` are collected; nothing is cached on disk.
    """
    if max_bytes is not None and max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks: list[bytes] = []
    size = 0
    for path in _stdlib_sources(root):
        if max_bytes is not None and size >= max_bytes:
            break
        data = path.read_bytes()
        chunks.append(data)
        size += len(data)
    corpus = b"".join(chunks)
    return corpus if max_bytes is None else corpus[:max_bytes]


def unigram_entropy(data: bytes) -> float:
    """Entropy in nats of the byte frequencies of `data`.

    This is the loss of the best model that ignores context; a language model's loss
    falling below it shows it has learned something from context.
    """
    if len(data) == 0:
        raise ValueError("unigram_entropy of empty data is undefined")
    counts = torch.bincount(torch.frombuffer(bytearray(data), dtype=torch.uint8), minlength=256)
    probs = counts[counts > 0].double() / len(data)
    return float(-(probs * probs.log()).sum())
