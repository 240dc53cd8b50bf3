"""What the three runners share: the step loop over the layers, attention over the cache,
and the output head that gathers vocabulary shards.

A runner is three kinds of modules, each called through its forward once per step:
`embed(ids, positions)`, every `layers[i](x, ctx)` (one decoder layer: it writes its
keys/values into the cache and attends over them), and `head(h)` (final norm, lm_head,
full-vocabulary fp32 logits). They wrap the model's own submodules, so parameters are the
model's (nothing is copied) and hooks on them (ZeRO-Inference gathers a layer's weights
in a forward pre-hook and releases them after) see one call per layer per step.

Note [never read a projection's weight]
Projections, embeddings and heads are called as modules: they may be tensor-parallel
(ColumnParallelLinear yields this rank's heads, RowParallelLinear all-reduces itself),
quantized, or offloaded, and only their forward knows. Head counts are read from the
projection outputs. Norm weights and epsilons are read directly: norms are replicated
and tiny, and the kernels in meshspeed.inference.kernels take them as arguments.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from meshspeed.comm.differentiable import gather_from_parallel
from meshspeed.inference.cache import ContiguousCache, PagedCache, Step, new_cache


@dataclass
class StepContext:
    """What every layer of one step reads: the cache, the step's indices, and per-step
    tensors a family computes once (rotary cos/sin, (B, 1, T, head_dim))."""

    cache: ContiguousCache | PagedCache
    step: Step
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: Step,
           scale: float) -> torch.Tensor:
    """q (B, H, T, hd) over k, v (B, KVH, L, hd) with the step's (B, 1, T, L) bool mask
    (or none, Note [no mask when rows are even] in cache.py) -> (B, T, H * hd). KVH < H is
    grouped-query attention: each kv head serves H / KVH query heads (enable_gqa, no
    repeated copy)."""
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads do not share {k.shape[1]} kv heads evenly")
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=step.mask, is_causal=step.causal,
                                       scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    B, _, T, _ = y.shape
    return y.transpose(1, 2).reshape(B, T, -1)


def heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """(B, T, n * head_dim) -> (B, n, T, head_dim); n comes from the tensor (this rank's)."""
    B, T, _ = x.shape
    return x.view(B, T, -1, head_dim).transpose(1, 2)


class TokenEmbed(nn.Module):
    """The token embedding alone (models whose positions enter through rotary, in the layers)."""

    def __init__(self, embedding: nn.Module) -> None:
        super().__init__()
        self.embedding = embedding

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.embedding(ids)


class Head(nn.Module):
    """Final norm + lm_head -> (B, vocab) fp32 logits of the whole vocabulary.

    A vocab-parallel lm_head returns this rank's shard (the last ranks' tail padded); it
    is gathered over the head's group and cut to `vocab_size`, so every rank holds the
    same logits."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module, vocab_size: int, norm_fn) -> None:
        super().__init__()
        self.norm, self.lm_head, self.vocab_size = norm, lm_head, vocab_size
        self.norm_fn = norm_fn  # (x, norm module) -> normed x, through the kernels

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.norm_fn(h, self.norm))
        if logits.shape[-1] < self.vocab_size:
            group = getattr(self.lm_head, "group", None)
            if group is None:
                raise ValueError(f"lm_head gives {logits.shape[-1]} logits for a vocabulary of "
                                 f"{self.vocab_size} and has no process group to gather the rest "
                                 f"from")
            logits = gather_from_parallel(logits, group, -1)
        return logits[..., :self.vocab_size].float()


def check_supported(model: nn.Module) -> None:
    """Refuse tensor-parallel layouts a cached step cannot run: sequence-parallel layers
    expect a sequence shard per rank and overlapped layers cut the sequence into chunks,
    but a decode step holds one token."""
    for name, module in model.named_modules():
        if getattr(module, "sequence_parallel", False) or getattr(module, "overlap_chunks", 1) > 1:
            raise ValueError(f"{name or type(model).__name__} is split with sequence_parallel or "
                             f"overlap_comm, which cached inference cannot run (a decode step has "
                             f"one token); split the model with apply_tensor_parallel("
                             f"sequence_parallel=False, overlap_comm=False) for inference")


class CachedRunner:
    """`meshspeed.inference.protocol.Runner` over `embed`, `layers` and `head` modules.

    Prompts of different lengths run as one right-padded batch: padding query rows are
    computed and thrown away, their keys never enter the cache, and each row's mask
    covers its own tokens only. Decode runs all sequences as one batch of one token."""

    def __init__(self, embed: nn.Module, layers: list[nn.Module], head: Head, vocab_size: int,
                 max_positions: int, device: torch.device) -> None:
        self.embed, self.layers, self.head = embed, nn.ModuleList(layers), head
        self.vocab_size, self.max_positions, self.device = vocab_size, max_positions, device

    def new_cache(self, kind: str, max_batch: int, max_tokens: int, block_size: int = 16,
                  num_blocks: int | None = None) -> ContiguousCache | PagedCache:
        if max_tokens > self.max_positions:
            raise ValueError(f"max_tokens={max_tokens} exceeds the model's {self.max_positions} "
                             f"positions")
        return new_cache(kind, len(self.layers), max_batch, max_tokens, block_size, num_blocks,
                         self.device)

    def context(self, cache, step: Step, x: torch.Tensor) -> StepContext:
        """Per-step tensors of a family (rotary tables); none by default."""
        return StepContext(cache, step)

    @torch.no_grad()
    def prefill(self, cache, seq_ids: list[int], prompts: list[torch.Tensor]) -> torch.Tensor:
        if len(seq_ids) != len(prompts):
            raise ValueError(f"prefill got {len(seq_ids)} sequence ids for {len(prompts)} prompts")
        prompts = [torch.as_tensor(p, dtype=torch.long).flatten() for p in prompts]
        counts = [p.numel() for p in prompts]
        for s, n in zip(seq_ids, counts):
            if n == 0 or n > self.max_positions:
                raise ValueError(f"prompt of sequence {s} has {n} tokens; it needs 1 to "
                                 f"{self.max_positions} (the model's positions)")
        step = cache.begin(list(seq_ids), counts, prefill=True)
        ids = torch.zeros(step.positions.shape, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, :p.numel()] = p
        x = self._layers(cache, step, ids.to(self.device))  # (B, T, d)
        last = x[torch.arange(len(prompts), device=x.device), torch.tensor(counts, device=x.device) - 1]  # (B, d)
        return self.head(last)

    @torch.no_grad()
    def decode(self, cache, seq_ids: list[int], tokens: torch.Tensor) -> torch.Tensor:
        tokens = torch.as_tensor(tokens, dtype=torch.long).flatten()
        if tokens.numel() != len(seq_ids):
            raise ValueError(f"decode got {tokens.numel()} tokens for {len(seq_ids)} sequences")
        for s in seq_ids:
            if s in cache and cache.length(s) >= self.max_positions:
                raise ValueError(f"sequence {s} already holds {cache.length(s)} tokens, the "
                                 f"model's {self.max_positions} positions")
        step = cache.begin(list(seq_ids), [1] * len(seq_ids), prefill=False)
        x = self._layers(cache, step, tokens.to(self.device)[:, None])  # (B, 1, d)
        return self.head(x[:, 0])

    def _layers(self, cache, step: Step, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids, step.positions)
        ctx = self.context(cache, step, x)
        for layer in self.layers:
            x = layer(x, ctx)
        return x
