"""What generation and the server need from a model: the `Runner` and `Cache` protocols.

A runner wraps one model (meshspeed's GPT, or a Hugging Face GPT-2 / Llama-family model,
whole or split by tensor parallelism) and runs it on sequences whose keys and values live
in a cache. Sequences are named by integer ids the caller chooses; the cache holds any
subset of them, each at its own length.

    cache = runner.new_cache("paged", max_batch=8, max_tokens=256, block_size=16)
    logits = runner.prefill(cache, [0, 1], [prompt0, prompt1])   # (2, vocab), last positions
    logits = runner.decode(cache, [0, 1], torch.tensor([t0, t1]))  # (2, vocab)
    cache.free(0)                                                  # its blocks are free now

Logits are fp32 over the whole vocabulary on every rank (under tensor parallelism the
runner gathers the vocabulary shards). `prefill` of an id already in the cache is an
error; so is `decode` of one that is not.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class Cache(Protocol):
    kind: str  # "contiguous" or "paged"

    def length(self, seq_id: int) -> int:
        """Tokens of `seq_id` held (prompt + generated so far)."""
        ...

    def free(self, seq_id: int) -> None:
        """Forget `seq_id`; a paged cache returns its blocks to the pool at once."""
        ...

    def free_blocks(self) -> int:
        """Blocks not held by any sequence (a contiguous cache: free slots)."""
        ...

    def can_admit(self, tokens: int) -> bool:
        """Whether one more sequence that will reach `tokens` tokens fits now."""
        ...


@runtime_checkable
class Runner(Protocol):
    vocab_size: int
    max_positions: int  # the model's longest sequence

    def new_cache(self, kind: str, max_batch: int, max_tokens: int, block_size: int = 16,
                  num_blocks: int | None = None) -> Cache: ...

    def prefill(self, cache: Cache, seq_ids: list[int], prompts: list[torch.Tensor]) -> torch.Tensor:
        """Run each prompt (1-D token ids, lengths may differ) into the cache under its id;
        (len(seq_ids), vocab) fp32 logits of each prompt's last position."""
        ...

    def decode(self, cache: Cache, seq_ids: list[int], tokens: torch.Tensor) -> torch.Tensor:
        """Append one token (tokens[i]) to each sequence; (len(seq_ids), vocab) fp32 logits."""
        ...
