"""ring_attention on 2 and 4 gloo ranks against attention of the whole sequence on one
process: outputs and input gradients, block counts, bytes on the ring, saved bytes.

One run_distributed call per world size (`_results`) runs every case; the tests below
read its results. Parity failures come back as messages naming the case."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from meshspeed import comm
from meshspeed.sequence.ring import BlockCounter, ring_attention
from meshspeed.sequence.sharding import SequenceLayout
from meshspeed.testing import run_distributed, world_sizes

B, D = 2, 8
TOL = {"atol": 1e-5, "rtol": 1e-5}


def _reference(q, k, v, causal):
    """Plain attention over the whole sequence (float64), kv heads repeated for GQA."""
    rep = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q @ k.transpose(-1, -2) / D**0.5
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v


def _whole(seq_len, h_q, h_kv, seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda h: torch.randn(B, h, seq_len, D, generator=g, dtype=torch.float64)
    return make(h_q), make(h_kv), make(h_kv), make(h_q)  # q, k, v, upstream gradient


def _chunk_shard(chunk_ids, rank, seq_len):
    """`shard(x)`: rank's chunks of x's sequence dim (2), in its order."""
    c = seq_len // sum(len(m) for m in chunk_ids)
    return lambda x: torch.cat([x.narrow(2, i * c, c) for i in chunk_ids[rank]], 2)


def _parity(name, group, chunk_ids, shard, seq_len, h_q, h_kv, causal,
            dtype=torch.float32, tol=TOL) -> list[str]:
    """Messages for every mismatch of out, dq, dk, dv on this rank ([] if none)."""
    Q, K, V, dO = _whole(seq_len, h_q, h_kv)
    leaves = [t.clone().requires_grad_() for t in (Q, K, V)]
    _reference(*leaves, causal).backward(dO)
    ref_out = _reference(Q, K, V, causal)
    q, k, v = (shard(t).to(dtype).requires_grad_() for t in (Q, K, V))
    out = ring_attention(q, k, v, group, causal=causal, chunk_ids=chunk_ids)
    out.backward(shard(dO).to(dtype))
    failures = []
    got = (out, q.grad, k.grad, v.grad)
    want = (ref_out, *(t.grad for t in leaves))
    for what, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        try:
            assert g.dtype == dtype
            assert_close(g.double(), shard(w), **tol)
        except AssertionError as err:
            failures.append(f"{name} causal={causal}: {what}: {err}")
    return failures


def _layout_cases(n: int, r: int) -> list[str]:
    failures = []
    for causal in (True, False):
        for balanced in (False, True):
            for per_chunk, h_q, h_kv in ((1, 4, 4), (3, 4, 2), (5, 2, 1)):
                layout = SequenceLayout(2 * n * per_chunk, n, balanced)
                ids = [layout.chunks(j) for j in range(n)]
                name = f"S={layout.seq_len} heads={h_q}/{h_kv} balanced={balanced}"
                failures += _parity(name, None, ids, functools.partial(layout.shard, rank=r, dim=2),
                                    layout.seq_len, h_q, h_kv, causal)
    return failures


def _other_cases(n: int, r: int) -> list[str]:
    failures = []
    # Four chunks per member, as the hybrid (ulysses x ring) layout gives: (0, 4n-1, 1, 4n-2), ...
    ids = [(2 * j, 4 * n - 1 - 2 * j, 2 * j + 1, 4 * n - 2 - 2 * j) for j in range(n)]
    for causal in (True, False):
        failures += _parity(f"chunks {ids}", None, ids, _chunk_shard(ids, r, 8 * n), 8 * n, 4, 2,
                            causal)
    # Rings on sub-groups, every rank in one: of size 1 at n = 2; {0, 1, 3} (odd, group rank 2
    # is global rank 3) and {2} at n = 4.
    members = [[i] for i in range(n)] if n == 2 else [[0, 1, 3], [2]]
    groups = [dist.new_group(m) for m in members]
    mine = next(g for g, m in zip(groups, members) if r in m)
    size, sub_rank = comm.get_world_size(mine), comm.get_rank(mine)
    layout = SequenceLayout(4 * size * 2, size, balanced=True)
    failures += _parity(f"ring on group {members}", mine, [layout.chunks(j) for j in range(size)],
                        lambda x: layout.shard(x, sub_rank, dim=2), layout.seq_len, 4, 2, True)
    if n == 2:
        # bfloat16: inputs exact, math in float32, but out, dq, dk, dv are rounded to bf16
        # (relative 2**-8) and delta = rowsum(dO * O) is taken from the rounded out.
        layout = SequenceLayout(16, n, balanced=True)
        failures += _parity("bfloat16", None, [layout.chunks(j) for j in range(n)],
                            lambda x: layout.shard(x, r, dim=2), 16, 4, 2, True,
                            dtype=torch.bfloat16, tol={"atol": 3e-2, "rtol": 3e-2})
    return failures


def _run_once(n, r, chunk_ids, s_local, h_q, h_kv, causal=True):
    g = torch.Generator().manual_seed(r)
    q = torch.randn(B, h_q, s_local, D, generator=g, requires_grad=True)
    k = torch.randn(B, h_kv, s_local, D, generator=g, requires_grad=True)
    v = torch.randn(B, h_kv, s_local, D, generator=g, requires_grad=True)
    return q, k, v, lambda: ring_attention(q, k, v, None, causal=causal, chunk_ids=chunk_ids)


def _blocks(n: int, r: int) -> dict:
    counts = {}
    for name, balanced, causal in (("contiguous", False, True), ("balanced", True, True),
                                   ("non-causal", False, False)):
        layout = SequenceLayout(4 * n, n, balanced)
        *_, attend = _run_once(n, r, [layout.chunks(j) for j in range(n)], 4, 2, 2, causal)
        with BlockCounter() as blocks:
            attend().sum().backward()
        counts[name] = (blocks.forward, blocks.backward)
    return counts


def _bytes(n: int, r: int) -> dict:
    layout = SequenceLayout(8 * n, n, balanced=True)
    _, k, _, attend = _run_once(n, r, [layout.chunks(j) for j in range(n)], 8, 4, 2)
    with comm.CommCounter() as forward:
        out = attend()
    with comm.CommCounter() as backward:
        out.sum().backward()
    return {"forward": forward.summary(), "backward": backward.summary(),
            "k_bytes": k.numel() * k.element_size()}


def _saved(n: int, r: int) -> dict:
    """Bytes saved for backward at a fixed local block (s_local = 8), and q+k+v+out+lse."""
    layout = SequenceLayout(8 * n, n, balanced=True)
    q, k, v, attend = _run_once(n, r, [layout.chunks(j) for j in range(n)], 8, 4, 2)
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = attend()
    lse_bytes = q.numel() // D * 4
    expected = sum(t.numel() * t.element_size() for t in (q, k, v, out)) + lse_bytes
    return {"saved": sum(saved), "expected": expected}


def _errors(n: int) -> dict:
    q, k = torch.zeros(1, 4, 8, D), torch.zeros(1, 2, 8, D)
    attempts = {
        "shapes": lambda: ring_attention(q, k, torch.zeros(1, 2, 6, D), None),
        "chunk_ids length": lambda: ring_attention(q, k, k, None, chunk_ids=[(0,)]),
        "indivisible": lambda: ring_attention(q, k, k, None, chunk_ids=[(0, 1, 2), (3, 4, 5)]),
        "kv heads": lambda: ring_attention(q, torch.zeros(1, 3, 8, D), torch.zeros(1, 3, 8, D),
                                           None),
    }
    messages = {}
    for name, attempt in attempts.items():
        try:
            attempt()
            messages[name] = None
        except ValueError as err:
            messages[name] = str(err)
    return messages


def _body():
    n, r = comm.get_world_size(), comm.get_rank()
    torch.set_num_threads(1)
    return {
        "failures": _layout_cases(n, r) + _other_cases(n, r),
        "blocks": _blocks(n, r),
        "bytes": _bytes(n, r),
        "saved": _saved(n, r),
        "errors": _errors(n) if n == 2 else None,
    }


@functools.cache
def _results(n: int) -> list[dict]:
    return run_distributed(_body, n, timeout=300)


@world_sizes(2, 4)
def test_outputs_and_gradients_match_whole_sequence_attention(world_size):
    # causal and not; contiguous and load-balanced layouts; S = 2n, 6n, 10n; heads 4/4, 4/2,
    # 2/1; four chunks per member; rings on sub-groups; a bf16 smoke case at n = 2.
    failures = [f for rank in _results(world_size) for f in rank["failures"]]
    assert failures == []


@world_sizes(2, 4)
def test_balanced_layout_gives_every_rank_the_same_blocks(world_size):
    n = world_size
    results = _results(n)
    for r, rank in enumerate(results):
        blocks = rank["blocks"]
        # Contiguous: rank r's query chunk r sees key chunks 0..r-1 fully and r on the diagonal.
        assert blocks["contiguous"][0] == {"full": r, "diagonal": 1, "skipped": n - 1 - r}
        # Balanced: chunks r and 2n-1-r. r sees 0..r-1 fully (r pairs); 2n-1-r sees every chunk
        # j < 2n-1-r, which is n (all of 0..n-1) plus n-1-r (n..2n-2-r); two diagonals; the other
        # 4n - (2n+1) pairs hidden. 2n+1 pairs computed on every rank.
        assert blocks["balanced"][0] == {"full": 2 * n - 1, "diagonal": 2, "skipped": 2 * n - 1}
        assert blocks["non-causal"][0] == {"full": n, "diagonal": 0, "skipped": 0}
        for forward, backward in blocks.values():
            assert backward == forward  # the backward computes the same pairs
    computed = {name: [rank["blocks"][name][0]["full"] + rank["blocks"][name][0]["diagonal"]
                       for rank in results] for name in ("contiguous", "balanced")}
    assert computed["contiguous"] == list(range(1, n + 1))  # unequal without balancing
    assert computed["balanced"] == [2 * n + 1] * n


@world_sizes(2, 4)
def test_bytes_on_the_ring(world_size):
    n = world_size
    for rank in _results(n):
        kv = 2 * rank["bytes"]["k_bytes"]  # K and V packed, float32 (GQA: 2 of 4 heads)
        fwd, bwd = rank["bytes"]["forward"], rank["bytes"]["backward"]
        # Forward: n - 1 hops of this rank's K/V-sized block, each a send and a receive.
        for op in ("send", "recv"):
            assert fwd[op] == {"calls": n - 1, "bytes": (n - 1) * kv}
            # Backward: n - 1 hops of K/V and n of dK/dV (float32, the size of K/V here).
            assert bwd[op] == {"calls": 2 * n - 1, "bytes": (n - 1) * kv + n * kv}
        assert sum(s["bytes"] for op, s in fwd.items() if op not in ("send", "recv")) == 0
        assert sum(s["bytes"] for op, s in bwd.items() if op not in ("send", "recv")) == 0


def test_saved_bytes_do_not_grow_with_the_ring():
    # Memory per rank does not grow with the ring size: tested in bytes, local block fixed.
    saved = {n: [rank["saved"] for rank in _results(n)] for n in (2, 4)}
    expected = saved[2][0]["expected"]  # q, k, v, out and the float32 lse
    assert {s["saved"] for ranks in saved.values() for s in ranks} == {expected}


def test_bad_arguments_are_named():
    messages = _results(2)[0]["errors"]
    assert "q, k, v must be" in messages["shapes"]
    assert "chunk_ids has 1 entries but the ring's group has 2" in messages["chunk_ids length"]
    assert "s_local = 8 is not divisible by the 3 chunks" in messages["indivisible"]
    assert "3 key/value heads do not divide 4 query heads" in messages["kv heads"]


@pytest.fixture(autouse=True, scope="module")
def _forget_results():
    yield
    _results.cache_clear()
