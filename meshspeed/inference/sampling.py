"""Choosing the next token from logits: greedy, temperature, top-k and top-p, seeded.

`SamplingParams` is one request's choice; `next_tokens` picks one token per row. With
`do_sample=False` (or temperature 0) the pick is the argmax, the same as Hugging Face's
greedy search (ties go to the lowest id). Sampling draws from a `torch.Generator` the
caller owns (one per request: a request's tokens depend on its own seed only, not on what
else is in the batch), after temperature, then top-k, then top-p (the smallest set of
most likely tokens whose probability reaches p; the most likely token always stays).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None  # keep the k most likely tokens (None or 0: all)
    top_p: float | None = None  # keep the most likely tokens up to this much probability
    seed: int | None = None  # a request's generator seed (None: the global generator)

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator | None:
        if self.seed is None:
            return None
        return torch.Generator(device=device).manual_seed(self.seed)


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(n, vocab) fp32 logits -> the same with temperature applied and the tokens outside
    top-k / top-p set to -inf."""
    logits = logits.float() / params.temperature
    if params.top_k:
        k = min(params.top_k, logits.shape[-1])
        kth = torch.topk(logits, k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p is not None and params.top_p < 1:
        ordered, order = torch.sort(logits, dim=-1, descending=True)
        probs = ordered.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # probability of the tokens ahead of each
        drop = before >= params.top_p  # the first token has 0 ahead: always kept
        ordered = ordered.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, ordered)
    return logits


def next_tokens(logits: torch.Tensor, params: SamplingParams,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """(n, vocab) logits of the last position -> (n,) token ids."""
    if params.greedy:
        return logits.argmax(dim=-1)
    probs = filter_logits(logits, params).softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
