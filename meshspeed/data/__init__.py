"""Data: a corpus every machine has, byte windows over it, and per-rank loaders."""

from meshspeed.data.corpus import stdlib_corpus, unigram_entropy
from meshspeed.data.dataset import ByteWindows
from meshspeed.data.loader import RepeatingLoader, distributed_dataloader

__all__ = [
    "ByteWindows",
    "RepeatingLoader",
    "distributed_dataloader",
    "stdlib_corpus",
    "unigram_entropy",
]
