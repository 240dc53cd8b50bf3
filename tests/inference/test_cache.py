"""The KV caches on their own: block and slot bookkeeping (allocation, growth across block
boundaries, free, reuse, errors) and what `update` returns against a plain per-sequence
history kept in Python lists (exact: it is copying, no arithmetic)."""

from __future__ import annotations

import pytest
import torch

from meshspeed.inference.cache import CacheFullError, ContiguousCache, PagedCache, new_cache
from meshspeed.inference.protocol import Cache

HEADS, HD = 2, 3


def _kv(counts: list[int], seed: int) -> torch.Tensor:
    """(B, HEADS, max(counts), HD) with row b's first counts[b] tokens real."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(len(counts), HEADS, max(counts), HD, generator=g)


def test_protocol_and_factory():
    paged = new_cache("paged", 2, max_batch=3, max_tokens=10, block_size=4)
    contiguous = new_cache("contiguous", 2, max_batch=3, max_tokens=10)
    assert isinstance(paged, Cache) and isinstance(contiguous, Cache)
    assert paged.num_blocks == 3 * 3  # ceil(10 / 4) blocks for each of 3 sequences
    assert (paged.kind, contiguous.kind) == ("paged", "contiguous")
    with pytest.raises(ValueError, match="'contiguous' or 'paged'"):
        new_cache("ring", 2, 3, 10)


def test_paged_allocation_growth_free_reuse():
    c = PagedCache(num_layers=1, num_blocks=6, block_size=4, max_tokens=16)
    c.begin([7, 9], [5, 3], prefill=True)  # 7: 2 blocks, 9: 1 block
    assert c.tables == {7: [0, 1], 9: [2]} and c.free_blocks() == 3
    assert (c.length(7), c.length(9)) == (5, 3)
    c.begin([9], [1], prefill=False)  # 9 reaches 4 tokens: still one block
    assert c.tables[9] == [2] and c.free_blocks() == 3
    c.begin([9], [1], prefill=False)  # 5 tokens: across the boundary, a new block
    assert c.tables[9] == [2, 3] and c.free_blocks() == 2
    assert c.can_admit(8) and not c.can_admit(9)
    c.free(7)  # its two blocks are free at once
    assert c.free_blocks() == 4 and 7 not in c
    c.begin([11], [8], prefill=True)  # reuses the freed blocks first
    assert c.tables[11] == [0, 1]


def test_paged_errors():
    c = PagedCache(num_layers=1, num_blocks=3, block_size=4, max_tokens=12)
    c.begin([0], [8], prefill=True)
    with pytest.raises(CacheFullError, match="out of blocks.*2 more blocks.*only 1 of num_blocks=3"):
        c.begin([1], [5], prefill=True)
    assert 1 not in c and c.free_blocks() == 1  # a failed step changes nothing
    with pytest.raises(ValueError, match="already in the cache"):
        c.begin([0], [1], prefill=True)
    with pytest.raises(KeyError, match="sequence 5 is not in the paged cache"):
        c.begin([5], [1], prefill=False)
    with pytest.raises(CacheFullError, match="reach 13 tokens.*max_tokens=12"):
        c.begin([2], [13], prefill=True)
    with pytest.raises(ValueError, match="must differ"):
        c.begin([3, 3], [1, 1], prefill=True)
    with pytest.raises(KeyError):
        c.free(42)


def test_contiguous_slots_and_errors():
    c = ContiguousCache(num_layers=1, max_batch=2, max_tokens=8)
    c.begin([4, 5], [3, 2], prefill=True)
    assert c.slots == {4: 0, 5: 1} and c.free_blocks() == 0 and not c.can_admit(1)
    with pytest.raises(CacheFullError, match="out of slots.*max_batch=2"):
        c.begin([6], [1], prefill=True)
    c.free(4)
    assert c.free_blocks() == 1 and c.can_admit(8) and not c.can_admit(9)
    c.begin([6], [1], prefill=True)
    assert c.slots[6] == 0


@pytest.mark.parametrize("kind", ["paged", "contiguous"])
def test_update_returns_each_history(kind):
    """Prefill three sequences of different lengths, decode them (one drops out and a new
    one joins); every step's keys/values per row equal that row's history, and the mask
    is causal over the row's own tokens."""
    c = new_cache(kind, 2, max_batch=6, max_tokens=12, block_size=3)
    hist: dict[int, list[torch.Tensor]] = {}

    def step(ids, counts, prefill, seed):
        st = c.begin(ids, counts, prefill)
        for layer in range(2):
            k, v = _kv(counts, seed + layer), _kv(counts, seed + 100 + layer)
            K, V = c.update(layer, st, k, v)
            L = st.keys
            mask = st.mask
            if mask is None:  # only when rows are even: then causal over positions is all
                assert len(set(counts)) == 1 and len({c.length(s) for s in ids}) == 1
                assert st.causal == (counts[0] > 1)
                mask = (torch.arange(L) <= st.positions[:, :, None])[:, None]
            assert K.shape == (len(ids), HEADS, L, HD)
            for b, s in enumerate(ids):
                key = (s, layer)
                hist.setdefault(key, [])
                hist[key] += [(k[b, :, t], v[b, :, t]) for t in range(counts[b])]
                n = len(hist[key])
                assert torch.equal(K[b, :, :n], torch.stack([x for x, _ in hist[key]], 1))
                assert torch.equal(V[b, :, :n], torch.stack([y for _, y in hist[key]], 1))
                start = n - counts[b]
                for t in range(counts[b]):  # query t sees keys 0..start+t only
                    want = torch.arange(L) <= start + t
                    assert torch.equal(mask[b, 0, t], want)

    step([0, 1, 2], [5, 2, 4], True, 0)
    for i in range(4):  # 0 crosses block boundaries at 6 and 9 tokens
        step([0, 1, 2], [1, 1, 1], False, 10 + i)
    c.free(1)
    step([3], [3], True, 30)
    step([2, 0, 3], [1, 1, 1], False, 40)  # rows in another order than slots
    step([4, 5], [2, 2], True, 50)  # even rows: no mask, causal
    step([4, 5], [1, 1], False, 60)  # even decode: no mask
    assert [c.length(s) for s in (0, 2, 3, 4, 5)] == [10, 9, 4, 3, 3]
