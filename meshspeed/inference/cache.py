"""KV caches for generation: contiguous (one slot per sequence) and paged (a block pool).

Both follow `meshspeed.inference.protocol.Cache` and add what a runner needs for one
step of the model over a set of sequences:

    step = cache.begin(seq_ids, new_tokens, prefill=True)  # allocate, plan indices (once)
    k_all, v_all = cache.update(layer, step, k, v)          # per layer: write new, read all

`begin` is the only place that does per-sequence Python work; `update` is a few tensor
ops per layer whatever the batch. `k`/`v` are (B, kv_heads, T, head_dim) with each
sequence's new tokens at the left of T (row b holds `new_tokens[b]` real ones); the
result is (B, kv_heads, L, head_dim) where L is the longest sequence after the step, with
`step.mask` (B, 1, T, L) saying which keys each query may see (causal, own tokens only;
None with `step.causal` when rows are even, Note [no mask when rows are even]).

Storage is allocated at a layer's first write, from the shape and dtype of what the
model produced: kv heads and head_dim are read from the projection outputs (under tensor
parallelism this rank's heads; a quantized projection's output dtype), never from a
config (Note [kv shapes come from the model]).

Note [kv shapes come from the model]
A tensor-parallel k_proj yields kv_heads / tp heads, a quantized one may return another
dtype; asking the model config would get both wrong. So a cache knows only its layers
and token capacity until the first write.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


class CacheFullError(RuntimeError):
    """The cache has no room for the tokens a step asked for."""


@dataclass
class Step:
    """Indices for one model step over `seq_ids`, shared by every layer."""

    seq_ids: list[int]
    new_tokens: list[int]  # real new tokens per row
    positions: torch.Tensor  # (B, T) absolute positions of the new tokens (padding: last real)
    valid: torch.Tensor | None  # (B, T) bool, which of the T query rows are real (None: T == 1)
    mask: torch.Tensor | None  # (B, 1, T, L) bool, key j visible to query t of row b;
    #   None when no row is shorter than another (Note [no mask when rows are even])
    causal: bool  # with mask None: queries see keys up to their own position (T == L)
    keys: int  # L, the longest row after the step
    write: torch.Tensor  # cache-specific index of each real new token (row-major over valid)
    read: torch.Tensor | slice  # cache-specific index of the keys of each row
    decode: bool  # T == 1, every row real: writes need no `valid` selection


# Note [no mask when rows are even]
# When every row has the same start and count (a batch of equal prompts, or decode of
# sequences of one length) nothing needs masking but causality, and SDPA's unmasked path
# is the fast one: the step carries mask=None and `causal` (prefill from 0) instead.


def _plan(starts: list[int], counts: list[int], device) -> tuple:
    """positions, valid, mask and causal of a step whose rows hold `counts` new tokens
    after `starts` cached ones."""
    T, L = max(counts), max(s + c for s, c in zip(starts, counts))
    both = torch.tensor([starts, counts], dtype=torch.long, device=device)[:, :, None]
    start, count = both[0], both[1]  # (B, 1) each
    t = torch.arange(T, device=device)[None, :]  # (1, T)
    valid = t < count  # (B, T)
    positions = start + torch.minimum(t, count - 1)  # padding rows repeat the last position
    if len(set(starts)) == 1 and len(set(counts)) == 1 and starts[0] == 0:  # even prompts
        return positions, valid, None, True
    keys = torch.arange(L, device=device)[None, None, :]  # (1, 1, L)
    mask = keys <= positions[:, :, None]  # causal; keys past a row's end are > its positions
    return positions, valid, mask[:, None], False  # mask (B, 1, T, L)


class _CacheBase:
    kind = ""

    def __init__(self, num_layers: int, max_tokens: int, device: torch.device | str | None) -> None:
        if num_layers < 1 or max_tokens < 1:
            raise ValueError(f"a cache needs num_layers >= 1 and max_tokens >= 1, got "
                             f"num_layers={num_layers}, max_tokens={max_tokens}")
        self.num_layers, self.max_tokens, self.device = num_layers, max_tokens, device
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers
        self.lengths: dict[int, int] = {}

    def length(self, seq_id: int) -> int:
        self._known(seq_id)
        return self.lengths[seq_id]

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self.lengths

    def _known(self, seq_id: int) -> None:
        if seq_id not in self.lengths:
            raise KeyError(f"sequence {seq_id} is not in the {self.kind} cache (held: "
                           f"{sorted(self.lengths)}); prefill it first")

    def begin(self, seq_ids: list[int], new_tokens: list[int], prefill: bool) -> Step:
        """Reserve room for `new_tokens[i]` more tokens of each sequence (new ones when
        `prefill`, else already held) and plan the step's indices."""
        self._check(seq_ids, new_tokens, prefill)
        starts = [0 if prefill else self.lengths[s] for s in seq_ids]
        self._reserve(seq_ids, starts, new_tokens)  # may raise: nothing recorded before this
        for s, start, n in zip(seq_ids, starts, new_tokens):
            self.lengths[s] = start + n
        L = max(st + n for st, n in zip(starts, new_tokens))
        if max(new_tokens) == 1:
            return self._single_step(list(seq_ids), starts, L)
        positions, valid, mask, causal = _plan(starts, new_tokens, self.device)
        write, read = self._indices(seq_ids, starts, new_tokens, positions, valid)
        return Step(list(seq_ids), new_tokens, positions, valid, mask, causal, L, write, read, False)

    # Note [one small tensor per decode step]
    # A decode step runs once per generated token, so its planning is per-token overhead:
    # each row's position, write index and read indices go into one tensor built from one
    # Python list (`_single`), and the step's indices are views of it.

    def _single_step(self, seq_ids: list[int], starts: list[int], L: int) -> Step:
        """The step of one new token per row (decode)."""
        rows = [[st, *row] for st, row in zip(starts, self._single(seq_ids, starts, L))]
        table = torch.tensor(rows, dtype=torch.long, device=self.device)
        positions = table[:, :1]  # (B, 1)
        mask = None  # rows of one length see all L keys (Note [no mask when rows are even])
        if len(set(starts)) > 1:
            mask = (torch.arange(L, device=self.device) <= positions[:, :, None])[:, None]
        write, read = self._single_split(table, seq_ids)
        return Step(seq_ids, [1] * len(seq_ids), positions, None, mask, False, L, write, read, True)

    def _check(self, seq_ids: list[int], new_tokens: list[int], prefill: bool) -> None:
        if len(seq_ids) != len(new_tokens) or not seq_ids:
            raise ValueError(f"a step needs one new-token count per sequence, got {len(seq_ids)} "
                             f"ids and {len(new_tokens)} counts")
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"sequence ids of one step must differ, got {seq_ids}")
        for s, n in zip(seq_ids, new_tokens):
            if prefill and s in self.lengths:
                raise ValueError(f"sequence {s} is already in the cache; free it before prefilling "
                                 f"it again")
            if not prefill:
                self._known(s)
            if n < 1:
                raise ValueError(f"sequence {s}: a step adds at least one token, got {n}")
            reach = (0 if prefill else self.lengths[s]) + n
            if reach > self.max_tokens:
                raise CacheFullError(f"sequence {s} would reach {reach} tokens, more than the "
                                     f"cache's max_tokens={self.max_tokens}")

    def update(self, layer: int, step: Step, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this layer's new k, v (B, kv_heads, T, head_dim); return all keys and
        values of the step's rows (B, kv_heads, L, head_dim)."""
        if self.k[layer] is None:
            self.k[layer], self.v[layer] = self._storage(k), self._storage(v)
        self._write(self.k[layer], step, k)
        self._write(self.v[layer], step, v)
        return self._read(self.k[layer], step), self._read(self.v[layer], step)

    @staticmethod
    def _new_rows(step: Step, x: torch.Tensor) -> torch.Tensor:
        """(N, kv_heads, head_dim): the real new tokens of x (B, kv_heads, T, head_dim)."""
        if step.decode:
            return x[:, :, 0]
        return x.transpose(1, 2)[step.valid]


class ContiguousCache(_CacheBase):
    """One slot of `max_tokens` positions per sequence: per layer K and V are
    (max_batch, kv_heads, max_tokens, head_dim). Simple and fast to read (a slice when the
    step's slots are consecutive) but every sequence reserves the longest length."""

    kind = "contiguous"

    def __init__(self, num_layers: int, max_batch: int, max_tokens: int,
                 device: torch.device | str | None = None) -> None:
        super().__init__(num_layers, max_tokens, device)
        if max_batch < 1:
            raise ValueError(f"a contiguous cache needs max_batch >= 1, got {max_batch}")
        self.max_batch = max_batch
        self.slots: dict[int, int] = {}
        self._free = list(range(max_batch - 1, -1, -1))  # pop() gives the lowest slot

    def free(self, seq_id: int) -> None:
        self._known(seq_id)
        del self.lengths[seq_id]
        self._free.append(self.slots.pop(seq_id))
        self._free.sort(reverse=True)

    def free_blocks(self) -> int:
        return len(self._free)

    def can_admit(self, tokens: int) -> bool:
        return bool(self._free) and tokens <= self.max_tokens

    def _reserve(self, seq_ids, starts, counts) -> None:
        new = [s for s in seq_ids if s not in self.slots]
        if len(new) > len(self._free):
            raise CacheFullError(f"contiguous cache out of slots: {len(new)} new sequences but "
                                 f"{len(self._free)} of max_batch={self.max_batch} slots are free; "
                                 f"free finished sequences or raise max_batch")
        for s in new:
            self.slots[s] = self._free.pop()

    def _indices(self, seq_ids, starts, counts, positions, valid):
        slots = [self.slots[s] for s in seq_ids]
        slot_t = torch.tensor(slots, dtype=torch.long, device=self.device)
        rows = slot_t[:, None].expand_as(positions)[valid]
        write = torch.stack((positions[valid], rows), 1)  # (N, 2): position and slot of each token
        return write, self._read_index(slots, slot_t)

    def _single(self, seq_ids, starts, L) -> list[list[int]]:
        return [[self.slots[s]] for s in seq_ids]

    def _single_split(self, table: torch.Tensor, seq_ids):
        return table, self._read_index([self.slots[s] for s in seq_ids], table[:, 1])  # table: (pos, slot)

    @staticmethod
    def _read_index(slots: list[int], slot_t: torch.Tensor) -> torch.Tensor | slice:
        """Consecutive slots read as a slice (a view, no copy)."""
        first = slots[0]
        return slice(first, first + len(slots)) if slots == list(range(first, first + len(slots))) else slot_t

    def _storage(self, x: torch.Tensor) -> torch.Tensor:
        _, heads, _, head_dim = x.shape
        return x.new_zeros(self.max_batch, heads, self.max_tokens, head_dim)

    def _write(self, store: torch.Tensor, step: Step, x: torch.Tensor) -> None:
        store[step.write[:, 1], :, step.write[:, 0]] = self._new_rows(step, x)

    def _read(self, store: torch.Tensor, step: Step) -> torch.Tensor:
        return store[step.read, :, :step.keys]


class PagedCache(_CacheBase):
    """A pool of `num_blocks` blocks of `block_size` tokens shared by all sequences: per
    layer K and V are (num_blocks, block_size, kv_heads, head_dim), and each sequence owns
    a block table (its blocks in order). Blocks are taken as a sequence grows and given
    back by `free` at once, so sequences of different lengths share one pool (vLLM's
    PagedAttention idea, arXiv:2309.06180)."""

    kind = "paged"

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, max_tokens: int,
                 device: torch.device | str | None = None) -> None:
        super().__init__(num_layers, max_tokens, device)
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a paged cache needs num_blocks >= 1 and block_size >= 1, got "
                             f"num_blocks={num_blocks}, block_size={block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.tables: dict[int, list[int]] = {}
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() gives the lowest block

    def free(self, seq_id: int) -> None:
        self._known(seq_id)
        del self.lengths[seq_id]
        self._free.extend(reversed(self.tables.pop(seq_id)))

    def free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)

    def can_admit(self, tokens: int) -> bool:
        return tokens <= self.max_tokens and self.blocks_for(tokens) <= len(self._free)

    def _reserve(self, seq_ids, starts, counts) -> None:
        need = {s: self.blocks_for(st + n) - len(self.tables.get(s, ()))
                for s, st, n in zip(seq_ids, starts, counts)}
        total = sum(need.values())
        if total > len(self._free):
            short = {s: n for s, n in need.items() if n > 0}
            raise CacheFullError(f"paged cache out of blocks: the step needs {total} more blocks of "
                                 f"{self.block_size} tokens (per sequence {short}) but only "
                                 f"{len(self._free)} of num_blocks={self.num_blocks} are free; free "
                                 f"finished sequences or make the pool larger")
        for s, n in need.items():
            table = self.tables.setdefault(s, [])
            table.extend(self._free.pop() for _ in range(n))

    def _indices(self, seq_ids, starts, counts, positions, valid):
        bs, L = self.block_size, max(st + n for st, n in zip(starts, counts))
        width = self.blocks_for(L)
        tables = torch.tensor([t + [0] * (width - len(t)) for t in (self.tables[s] for s in seq_ids)],
                              dtype=torch.long, device=self.device)  # (B, width); past a row's end: 0, masked
        # a new token's slot = block * block_size + offset in the pool seen as (num_blocks * bs, ...)
        block = tables.gather(1, positions // bs)  # (B, T)
        write = (block * bs + positions % bs)[valid]  # (N,)
        return write, tables.flatten()  # reads take whole blocks: one index per block, not per token

    def _single(self, seq_ids, starts, L) -> list[list[int]]:
        bs, width = self.block_size, self.blocks_for(L)
        rows = []
        for s, st in zip(seq_ids, starts):
            t = self.tables[s]
            rows.append([t[st // bs] * bs + st % bs, *t, *[0] * (width - len(t))])
        return rows

    def _single_split(self, table: torch.Tensor, seq_ids):
        return table[:, 1], table[:, 2:].flatten()  # table: (pos, write slot, blocks...)

    def _storage(self, x: torch.Tensor) -> torch.Tensor:
        _, heads, _, head_dim = x.shape
        return x.new_zeros(self.num_blocks, self.block_size, heads, head_dim)

    def _write(self, store: torch.Tensor, step: Step, x: torch.Tensor) -> None:
        store.view(-1, *store.shape[2:]).index_copy_(0, step.write, self._new_rows(step, x))

    def _read(self, store: torch.Tensor, step: Step) -> torch.Tensor:
        B = len(step.seq_ids)
        blocks = store.index_select(0, step.read)  # (B * width, bs, kv_heads, head_dim)
        keys = blocks.view(B, -1, *store.shape[2:])[:, :step.keys]  # (B, L, kv_heads, head_dim)
        return keys.transpose(1, 2)  # (B, kv_heads, L, head_dim)


def new_cache(kind: str, num_layers: int, max_batch: int, max_tokens: int, block_size: int = 16,
              num_blocks: int | None = None, device: torch.device | str | None = None
              ) -> ContiguousCache | PagedCache:
    """A cache of `kind` for `num_layers` layers. A paged cache without `num_blocks` gets
    enough blocks for `max_batch` sequences of `max_tokens` tokens."""
    if kind == "contiguous":
        return ContiguousCache(num_layers, max_batch, max_tokens, device)
    if kind == "paged":
        if num_blocks is None:
            num_blocks = max_batch * math.ceil(max_tokens / block_size)
        return PagedCache(num_layers, num_blocks, block_size, max_tokens, device)
    raise ValueError(f"cache kind must be 'contiguous' or 'paged', got {kind!r}")
