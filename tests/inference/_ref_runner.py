"""A reference `Runner` for the server's tests: no cache cleverness, easy to trust.

`RefRunner` keeps each sequence's tokens and recomputes the reference GPT over the whole
sequence on every call, one sequence at a time, so a sequence's logits cannot depend on
what shares its batch. `RefCache` counts blocks like a paged pool (taken as tokens arrive;
an error when the pool runs dry or a sequence passes max_tokens) or slots like a
contiguous cache, so the server's admission and freeing can be observed. It records every
call in `RefRunner.calls`.
"""

import math

import torch

from meshspeed.models.gpt import GPT

VOCAB = 64


class RefCache:
    """Tokens per sequence; blocks counted, taken as a sequence grows (paged) or one slot
    per sequence (contiguous)."""

    def __init__(self, kind, max_batch, max_tokens, block_size, num_blocks):
        if kind not in ("paged", "contiguous"):
            raise ValueError(f"unknown cache kind {kind!r}")
        self.kind = kind
        self.block_size = block_size
        self.max_tokens = max_tokens
        if kind == "paged":
            self.num_blocks = num_blocks or max_batch * math.ceil(max_tokens / block_size)
        else:
            self.num_blocks = max_batch
        self.seqs: dict[int, list[int]] = {}

    def held(self, seq_id):
        if self.kind == "contiguous":
            return 1
        return math.ceil(len(self.seqs[seq_id]) / self.block_size)

    def length(self, seq_id):
        return len(self.seqs[seq_id])

    def free(self, seq_id):
        del self.seqs[seq_id]

    def free_blocks(self):
        return self.num_blocks - sum(self.held(s) for s in self.seqs)

    def can_admit(self, tokens):
        if self.kind == "contiguous":
            return self.free_blocks() >= 1 and tokens <= self.max_tokens
        return self.free_blocks() >= math.ceil(tokens / self.block_size)

    def append(self, seq_id, tokens):
        self.seqs.setdefault(seq_id, []).extend(tokens)
        if self.free_blocks() < 0:
            raise RuntimeError("cache pool exhausted")
        if len(self.seqs[seq_id]) > self.max_tokens:
            raise RuntimeError(f"sequence {seq_id} passed max_tokens")


class RefRunner:
    def __init__(self, model: GPT):
        self.model = model
        self.vocab_size = model.config.vocab_size
        self.max_positions = model.config.max_seq_len
        self.calls: list[tuple[str, list[int]]] = []  # ("prefill" | "decode", seq ids)

    def new_cache(self, kind, max_batch, max_tokens, block_size=16, num_blocks=None):
        self.cache = RefCache(kind, max_batch, max_tokens, block_size, num_blocks)
        return self.cache

    @torch.no_grad()
    def _last_logits(self, cache, seq_ids):
        rows = [self.model(torch.tensor([cache.seqs[i]]))[0, -1] for i in seq_ids]
        return torch.stack(rows).float()

    def prefill(self, cache, seq_ids, prompts):
        self.calls.append(("prefill", list(seq_ids)))
        for i, p in zip(seq_ids, prompts):
            if i in cache.seqs:
                raise RuntimeError(f"sequence {i} already in the cache")
            cache.append(i, p.tolist())
        return self._last_logits(cache, seq_ids)

    def decode(self, cache, seq_ids, tokens):
        self.calls.append(("decode", list(seq_ids)))
        for i, t in zip(seq_ids, tokens.tolist()):
            if i not in cache.seqs:
                raise RuntimeError(f"sequence {i} is not in the cache")
            cache.append(i, [t])
        return self._last_logits(cache, seq_ids)
