"""DeepSpeed-Ulysses against attention of the whole sequence on one process, at world
sizes 2 and 4 (gloo): outputs and the gradients of q, k and v (random upstream gradient)
within 1e-5 in fp32, over layouts, masks, sequence lengths, head counts (multi-head,
grouped-query with P | h_kv, grouped-query with h_kv | P), the default and a caller's
local attention, rotary embeddings; the bytes of the all-to-alls against Note [Ulysses
communication volume]; and the errors for head counts that cannot be split.

Every rank builds the same full tensors from fixed seeds and takes its contiguous slice of
the sequence. Each rank process runs all cases of its world size in one call and returns
the ones that failed."""

from __future__ import annotations

import functools
import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from meshspeed import comm
from meshspeed.sequence import all_to_all
from meshspeed.sequence.all_to_all import seq_all_to_all, seq_all_to_all_many
from meshspeed.sequence.layer import DistributedAttention, ulysses_attention
from meshspeed.testing import run_distributed

B, D, ROT = 2, 8, 4  # batch, head_dim, rotary features (partial rotary: ROT < D)
TOL = {"rtol": 1e-5, "atol": 1e-5}
# layout -> (scatter_idx, gather_idx, batch_dim_idx passed); "bshd0" is batch-first with
# DeepSpeed's default gather_idx=0, which batch_dim_idx=0 overrides (Note [DeepSpeed's layouts])
LAYOUTS = {"sbhd": (2, 0, 1), "bshd": (2, 1, 0), "bhsd": (1, 2, 0), "bshd0": (2, 0, 0)}


# -- the reference: one process, canonical [B, S, H, D] -------------------------------------------


def _full(shape, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _angles(S: int) -> torch.Tensor:
    """(S, ROT/2) rotation angles of positions 0..S-1."""
    inv = 1.0 / (10000 ** (torch.arange(0, ROT, 2, dtype=torch.float32) / ROT))
    return torch.arange(S, dtype=torch.float32)[:, None] * inv[None, :]


def _rotary_reference(x: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary on [B, S, H, D], written with complex numbers."""
    S, half = x.shape[1], ROT // 2
    z = torch.complex(x[..., :half], x[..., half:ROT]) * torch.polar(torch.ones(S, half), _angles(S))[None, :, None]
    return torch.cat((z.real, z.imag, x[..., ROT:]), dim=-1)


def _reference(Q, K, V, causal: bool, rotary: bool) -> torch.Tensor:
    if rotary:
        Q, K = _rotary_reference(Q), _rotary_reference(K)
    rep = Q.shape[2] // K.shape[2]
    K, V = K.repeat_interleave(rep, dim=2), V.repeat_interleave(rep, dim=2)
    out = F.scaled_dot_product_attention(Q.transpose(1, 2), K.transpose(1, 2), V.transpose(1, 2), is_causal=causal)
    return out.transpose(1, 2)


def _cos_sin(S: int, layout: str):
    """DeepSpeed's rotary_pos_emb: [S, 1, 1, ROT] for batch-first q, [1, S, 1, ROT] seq-first."""
    a = torch.cat((_angles(S), _angles(S)), dim=-1)
    shape = (1, S, 1, ROT) if layout == "sbhd" else (S, 1, 1, ROT)
    return a.cos().reshape(shape), a.sin().reshape(shape)


# -- layouts and shards -------------------------------------------------------------------------


def _to(x: torch.Tensor, layout: str) -> torch.Tensor:
    return x.permute(["bshd".index(c) for c in layout[:4]]).contiguous()


def _from(x: torch.Tensor, layout: str) -> torch.Tensor:
    return x.permute([layout[:4].index(c) for c in "bshd"])


def _shard(x: torch.Tensor, layout: str, rank: int, n: int) -> torch.Tensor:
    """Rank `rank`'s contiguous slice of the sequence of canonical `x`, in `layout`."""
    y = _to(x, layout)
    dim = layout.index("s")
    return y.narrow(dim, rank * y.shape[dim] // n, y.shape[dim] // n).contiguous()


def _user_attention(q, k, v, *, layout: str, causal: bool):
    """A caller's local attention, in the layout, explicit math; it relies on the contract
    that its inputs are contiguous (as Megatron's core attention does with `.view`)."""
    assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous(), "local attention got a non-contiguous input"
    q, k, v = (_from(t, layout).transpose(1, 2) for t in (q, k, v))  # [b, h, S, d]
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        S = q.shape[2]
        scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    out = scores.softmax(-1) @ v  # [b, h, S, d]
    return _to(out.transpose(1, 2), layout)


# -- the cases ----------------------------------------------------------------------------------


def _heads(n: int) -> list[tuple[int, int]]:
    """(query heads, key/value heads): multi-head, P | h_kv, and h_kv | P (replicated)."""
    return [(2 * n, 2 * n), (2 * n, n), (2 * n, 1)] + ([(2 * n, 2)] if n == 4 else [])


def _layer_case(n: int, rank: int, layout: str, causal: bool, S: int, hq: int, hkv: int, user: bool,
                rotary: bool, pass_batch: bool, group=None) -> list[str]:
    """Run one DistributedAttention case over `group` (n ranks, this one `rank` in it);
    return what failed (empty if it matched)."""
    seed = S * 1000 + hq * 10 + hkv
    Q, K, V = _full((B, S, hq, D), seed), _full((B, S, hkv, D), seed + 1), _full((B, S, hkv, D), seed + 2)
    dO = _full((B, S, hq, D), seed + 3)
    full = [t.clone().requires_grad_() for t in (Q, K, V)]
    ref = _reference(*full, causal, rotary)
    ref.backward(dO)

    scatter, gather, batch = LAYOUTS[layout]
    local = _user_attention if user else None
    attn = DistributedAttention(local, group, scatter_idx=scatter, gather_idx=gather, causal=causal)
    qkv = [_shard(t, layout, rank, n).requires_grad_() for t in (Q, K, V)]
    extra = {"layout": layout, "causal": causal} if user else {}
    rope = _cos_sin(S, layout) if rotary else None
    out = attn(*qkv, batch if pass_batch or layout == "bshd0" else None, rope, **extra)
    out.backward(_shard(dO, layout, rank, n))

    name = f"{layout} causal={causal} S={S} heads={hq}/{hkv} user={user} rotary={rotary}"
    failed = []
    for what, got, want in [("out", out, ref.detach()), ("dq", qkv[0].grad, full[0].grad),
                            ("dk", qkv[1].grad, full[1].grad), ("dv", qkv[2].grad, full[2].grad)]:
        want = _shard(want, layout, rank, n)
        if got.shape != want.shape or not torch.allclose(got, want, **TOL):
            diff = (got - want).abs().max().item() if got.shape == want.shape else f"shape {tuple(got.shape)}"
            failed.append(f"{name}: {what} differs by {diff}")
    return failed


def _functional_case(n: int, rank: int, causal: bool, S: int, hq: int, hkv: int, custom: bool) -> list[str]:
    seed = 7 + S * 100 + hq * 10 + hkv
    Q, K, V = _full((B, S, hq, D), seed), _full((B, S, hkv, D), seed + 1), _full((B, S, hkv, D), seed + 2)
    dO = _full((B, S, hq, D), seed + 3)
    full = [t.clone().requires_grad_() for t in (Q, K, V)]
    ref = _reference(*full, causal, rotary=False)
    ref.backward(dO)
    qkv = [_shard(t, "bhsd", rank, n).requires_grad_() for t in (Q, K, V)]
    attention = None
    if custom:  # [b, h/P, S, d], the caller's own mask handling
        def attention(q, k, v):
            return _user_attention(q, k, v, layout="bhsd", causal=causal)
    out = ulysses_attention(*qkv, None, causal=causal, attention=attention)
    out.backward(_shard(dO, "bhsd", rank, n))
    failed = []
    for what, got, want in [("out", out, ref.detach()), ("dq", qkv[0].grad, full[0].grad),
                            ("dk", qkv[1].grad, full[1].grad), ("dv", qkv[2].grad, full[2].grad)]:
        if not torch.allclose(got, _shard(want, "bhsd", rank, n), **TOL):
            failed.append(f"ulysses_attention causal={causal} S={S} heads={hq}/{hkv} custom={custom}: {what}")
    return failed


def _parity_all() -> list[str]:
    torch.set_num_threads(1)
    n, rank = comm.get_world_size(), comm.get_rank()
    failed = []
    for i, (layout, causal, mult, (hq, hkv), user) in enumerate(itertools.product(
            LAYOUTS, (True, False), (1, 3), _heads(n), (False, True))):
        rotary = layout in ("sbhd", "bshd") and mult == 3
        failed += _layer_case(n, rank, layout, causal, n * mult, hq, hkv, user, rotary, pass_batch=i % 2 == 0)
    for causal, (hq, hkv), custom in itertools.product((True, False), _heads(n), (False, True)):
        failed += _functional_case(n, rank, causal, n * 5, hq, hkv, custom)
    return failed


def _everything() -> dict:
    return {"failed": _parity_all(), "bytes": _bytes_all()}


@functools.cache
def _results(world_size: int) -> list[dict]:
    """One run_distributed call per world size, shared by the parity and the bytes tests."""
    return run_distributed(_everything, world_size=world_size, timeout=240)


@pytest.mark.parametrize("world_size", [2, 4])
def test_ulysses_equals_full_attention(world_size):
    failed = [r["failed"] for r in _results(world_size)]
    assert failed == [[]] * world_size, "\n".join(next(f for f in failed if f))


# -- bytes moved, against Note [Ulysses communication volume] -------------------------------------


def _expected_bytes(n: int, s: int, hq: int, hkv: int, e: int = 4) -> int:
    """Forward plus backward, per rank: 2 x (q, k, v in + out back), each all-to-all
    sending (n-1)/n of its input; key/value heads replicated to n when fewer."""
    hkv_sent = hkv if hkv % n == 0 else n
    qkv = (n - 1) * e * B * s * D * (hq + 2 * hkv_sent) // n
    out = (n - 1) * e * B * s * D * hq // n
    return 2 * (qkv + out)


def _bytes_all() -> list[tuple]:
    """(case, all-to-all calls, their bytes, the formula's bytes, all bytes counted) for the
    layer and the functional form, forward and backward."""
    torch.set_num_threads(1)
    n, rank = comm.get_world_size(), comm.get_rank()
    s = 3
    rows = []
    for layout, (hq, hkv), user in itertools.product(("sbhd", "bshd"), _heads(n), (False, True)):
        Q, K, V = _full((B, n * s, hq, D), 1), _full((B, n * s, hkv, D), 2), _full((B, n * s, hkv, D), 3)
        qkv = [_shard(t, layout, rank, n).requires_grad_() for t in (Q, K, V)]
        scatter, gather, _ = LAYOUTS[layout]
        attn = DistributedAttention(_user_attention if user else None, None, scatter, gather)
        extra = {"layout": layout, "causal": True} if user else {}
        with comm.CommCounter() as counter:
            attn(*qkv, **extra).sum().backward()
        a2a = counter.summary()["all_to_all"]
        rows.append(((layout, hq, hkv, user), a2a["calls"], a2a["bytes"], _expected_bytes(n, s, hq, hkv),
                     counter.total_bytes()))
    for hq, hkv in _heads(n):
        Q, K, V = _full((B, n * s, hq, D), 1), _full((B, n * s, hkv, D), 2), _full((B, n * s, hkv, D), 3)
        qkv = [_shard(t, "bhsd", rank, n).requires_grad_() for t in (Q, K, V)]
        with comm.CommCounter() as counter:
            ulysses_attention(*qkv, None).sum().backward()
        a2a = counter.summary()["all_to_all"]
        rows.append((("functional", hq, hkv, False), a2a["calls"], a2a["bytes"], _expected_bytes(n, s, hq, hkv),
                     counter.total_bytes()))
    return rows


@pytest.mark.parametrize("world_size", [2, 4])
def test_all_to_all_bytes_match_the_formula(world_size):
    for rank_rows in (r["bytes"] for r in _results(world_size)):
        for (layout, hq, hkv, user), calls, got, want, total in rank_rows:
            assert got == want == total, (layout, hq, hkv, user, got, want, total)
            # q, k, v in one exchange and the output in another, each mirrored in backward;
            # a caller's attention in [s, b, h, d] gets three zero-copy exchanges instead
            assert calls == (8 if user and layout == "sbhd" else 4), (layout, hq, hkv, user, calls)


# -- the all-to-all alone, and the errors ---------------------------------------------------------


def _all_to_all_and_errors() -> dict:
    """seq_all_to_all against the permutation it stands for, on 4 ranks; shared collectives
    and buckets against one exchange per tensor; DistributedAttention over a group of 2 of
    the 4 ranks; then every error, raised identically on every rank."""
    n, rank = comm.get_world_size(), comm.get_rank()
    full = _full((n * 2, 3, n * 3, 5), 11)  # (sequence, batch, heads, d): every rank's slice stacked
    x = full.narrow(0, rank * 2, 2).clone().requires_grad_()
    y = seq_all_to_all(x, None, scatter_dim=2, gather_dim=0)
    expected = full.narrow(2, rank * 3, 3)
    upstream = _full(y.shape, 12 + rank)
    y.backward(upstream)
    # grad: rank r's slice of the sequence of every rank's upstream, heads reassembled in rank order
    grads = [_full(y.shape, 12 + j) for j in range(n)]
    want_grad = torch.cat([g.narrow(0, rank * 2, 2) for g in grads], dim=2)
    ok = {"value": torch.equal(y, expected), "grad": torch.equal(x.grad, want_grad), "contiguous": y.is_contiguous()}

    # shared collectives (batch-first, b = 3: the views ordering applies) against one exchange
    # per tensor: values, gradients, calls; then with buckets small enough to split them
    shapes = [(3, 2, 2 * n, 5), (3, 2, n, 5)]  # (batch, sequence, heads, d), heads differ
    inputs = [_full(shape, 20 + i + 10 * rank) for i, shape in enumerate(shapes)]
    weights = [_full((3, 2 * n, h // n, 5), 30 + i) for i, (_, _, h, _) in enumerate(shapes)]
    ways = {"views": lambda xs: seq_all_to_all_many(xs, None, 2, 1),
            "contiguous": lambda xs: seq_all_to_all_many(xs, None, 2, 1, contiguous=True),
            "alone": lambda xs: [seq_all_to_all(t, None, 2, 1) for t in xs]}
    got = {}
    for name, way in [*ways.items(), ("bucketed", ways["views"])]:
        xs = [t.clone().requires_grad_() for t in inputs]
        saved = all_to_all.CPU_BUCKET_BYTES
        if name == "bucketed":
            all_to_all.CPU_BUCKET_BYTES = inputs[0].numel() * 4
        try:
            with comm.CommCounter() as counter:
                ys = way(xs)
                sum((y * w).sum() for y, w in zip(ys, weights, strict=True)).backward()
        finally:
            all_to_all.CPU_BUCKET_BYTES = saved
        got[name] = ([y.detach() for y in ys] + [t.grad for t in xs], counter.summary()["all_to_all"]["calls"],
                     [y.is_contiguous() for y in ys])
    ok["shared"] = all(all(torch.equal(a, b) for a, b in zip(tensors, got["alone"][0], strict=True))
                       for tensors, _, _ in got.values())
    ok["calls"] = {name: calls for name, (_, calls, _) in got.items()} == {
        "views": 2, "contiguous": 2, "alone": 4, "bucketed": 4}
    ok["layouts"] = got["views"][2] == [False, False] and got["contiguous"][2] == [True, True]

    # a sequence group that is not the world: ranks {0, 1} and {2, 3}, each pair on its own
    import torch.distributed as dist

    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = pairs[rank // 2]
    ok["subgroup"] = all(not _layer_case(2, rank % 2, layout, True, 6, 4, 1, user, False, True, group=mine)
                         for layout in ("sbhd", "bshd") for user in (False, True))

    errors = {}

    def catch(name, fn):
        try:
            fn()
        except ValueError as err:
            errors[name] = str(err)

    def call(hq, hkv, **kw):
        q, kv = torch.zeros(2 * n, B, hq, D), torch.zeros(2 * n, B, hkv, D)
        return DistributedAttention(None, None, **kw)(q, kv, kv)

    catch("query heads", lambda: call(6, 6))
    catch("kv heads", lambda: call(12, 3))
    catch("gqa ratio", lambda: call(8, 3))
    catch("num_kv_heads", lambda: call(8, 4, num_kv_heads=2))
    catch("scatter_idx", lambda: DistributedAttention(None, None, scatter_idx=3))
    catch("3-d", lambda: DistributedAttention()(torch.zeros(4, 2, 8), torch.zeros(4, 2, 8), torch.zeros(4, 2, 8)))
    catch("uneven", lambda: seq_all_to_all(torch.zeros(2, 3, 5), None, 1, 0))
    catch("rotary", lambda: DistributedAttention()(
        torch.zeros(2, B, 8, D), torch.zeros(2, B, 8, D), torch.zeros(2, B, 8, D), None,
        (torch.ones(2 * n, 1, 1, ROT), torch.ones(2 * n, 1, 1, ROT))))
    catch("functional", lambda: ulysses_attention(torch.zeros(B, 12, 2, D), torch.zeros(B, 6, 2, D),
                                                  torch.zeros(B, 6, 2, D), None))
    return {"ok": ok, "errors": errors}


def test_all_to_all_and_head_count_errors():
    results = run_distributed(_all_to_all_and_errors, world_size=4, timeout=120)
    assert all(r == results[0] for r in results)
    assert all(results[0]["ok"].values()), results[0]["ok"]
    errors = results[0]["errors"]
    assert errors.keys() == {"query heads", "kv heads", "gqa ratio", "num_kv_heads", "scatter_idx", "3-d",
                             "uneven", "rotary", "functional"}, errors
    assert errors["query heads"] == ("6 query heads cannot be split over a sequence-parallel degree of 4: "
                                     "the number of query heads must be a multiple of 4")
    assert errors["kv heads"] == ("3 key/value heads cannot be split over a sequence-parallel degree of 4: "
                                  "use a multiple of 4 key/value heads, or a divisor of it (1, 2, 4)")
    assert "8 query heads cannot share 3 key/value heads" in errors["gqa ratio"]
    assert "num_kv_heads=2 but the key has 4 heads" in errors["num_kv_heads"]
    assert "scatter_idx=3 must be the heads dimension" in errors["scatter_idx"]
    assert "4-d query" in errors["3-d"] and "(4, 2, 8)" in errors["3-d"]
    assert "cannot split dim 1 of size 3" in errors["uneven"]
    assert "does not broadcast" in errors["rotary"] and "[1, S, 1, rot] for [s, b, h, d]" in errors["rotary"]
    assert "6 key/value heads cannot be split over a sequence-parallel degree of 4" in errors["functional"]
