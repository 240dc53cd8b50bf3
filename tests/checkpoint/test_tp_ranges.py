"""Index mapping of tensor-parallel checkpoints (Note [tensor-parallel ranges]), no processes.

A "layout" is tp x dp: each tp rank's local piece (TPShard, or the logical tensor at tp 1),
then ZeRO's ceil(numel / dp) ranges of that local tensor. `saved_checkpoint` writes real
rank files the way `snapshot.capture` does (padding left out) and a meta.json `params`
section; every rank of every other layout then fills its ranges through
`SavedTensors.fill`, and the whole logical tensor is consolidated.
"""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import pytest
import torch

from meshspeed.checkpoint import reshard, tp_ranges
from meshspeed.checkpoint.errors import CheckpointError
from meshspeed.checkpoint.metadata import check_coverage
from meshspeed.checkpoint.reshard import SavedTensors
from meshspeed.checkpoint.snapshot import _unpadded
from meshspeed.checkpoint.tensorfile import write_tensors
from meshspeed.topology.shards import TPShard, even_pieces

# name -> (logical shape, split dim, fused parts along dim)
CASES = {
    "column": ((8, 6), 0, None),
    "row": ((5, 8), 1, None),  # dim 1: one run per row of the piece
    "fused": ((12, 4), 0, (4, 4, 4)),  # q | k | v, three pieces per rank
    "vocab": ((13, 4), 0, None),  # padded at tp 2, 3 and 4
    "bias": ((10,), 0, None),
    "fused_row": ((3, 12), 1, (6, 6)),  # a fused split along dim 1
}
LAYOUTS = [(1, 1), (1, 3), (2, 1), (2, 2), (3, 2), (4, 3)]


def _fits(case: str, *tps: int) -> bool:
    """Whether the case's fused parts split over every tp in `tps` (cases that cannot are
    not generated, rather than skipped)."""
    parts = CASES[case][2]
    return parts is None or all(p % t == 0 for p in parts for t in tps)


def shard(case: str, tp_rank: int, tp: int) -> TPShard | None:
    shape, dim, parts = CASES[case]
    if tp == 1:
        return None
    if not _fits(case, tp):
        raise ValueError(f"{case} does not split over {tp}")
    pieces, local = even_pieces(shape[dim], tp_rank, tp, parts=parts)
    return TPShard(dim, shape, pieces, local, tp_rank, tp)


def local_shape(case: str, s: TPShard | None) -> tuple[int, ...]:
    return s.local_shape if s is not None else CASES[case][0]


def zero_ranges(numel: int, dp: int) -> list[tuple[int, int]]:
    each = -(-numel // dp)
    return [(min(numel, r * each), min(numel, (r + 1) * each)) for r in range(dp)]


def full_of(case: str) -> torch.Tensor:
    """Logical element i holds i + 1 (so 0 marks padding in a local tensor)."""
    shape = CASES[case][0]
    return torch.arange(1, math.prod(shape) + 1, dtype=torch.float32).view(shape)


def local_of(case: str, s: TPShard | None) -> torch.Tensor:
    full = full_of(case)
    return s.local_from_logical(full) if s is not None else full.clone()


def saved_checkpoint(tmp_path, case: str, tp: int, dp: int) -> SavedTensors:
    ranges, rank = [], 0
    for t in range(tp):
        s = shard(case, t, tp)
        flat = local_of(case, s).view(-1)
        for a, b in zero_ranges(flat.numel(), dp):
            if a == b:
                continue
            file = f"rank-{rank:05d}.safetensors"
            piece = _unpadded(flat[a:b], SimpleNamespace(tp=s, start=a, end=b))
            write_tensors(str(tmp_path / file), {f"master/{case}": piece.contiguous()})
            ranges.append({"rank": rank, "file": file, "start": a, "end": b, "optimizer": [],
                           **({"tp": s.to_json()} if s is not None else {})})
            rank += 1
    meta = {"params": {case: {"shape": list(CASES[case][0]), "ranges": ranges}}}
    check_coverage(meta)
    return SavedTensors(str(tmp_path), meta)


# -- runs ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("case,tp", [(c, t) for c in CASES for t in (2, 3, 4) if _fits(c, t)])
def test_runs_map_local_to_logical(case, tp):
    """Every run is contiguous in both tensors; the runs of any range hold exactly its
    non-padding elements, in local order."""
    for t in range(tp):
        s = shard(case, t, tp)
        local = local_of(case, s).view(-1)  # logical index + 1, 0 on padding
        n = local.numel()
        for a, b in [(0, n), *zero_ranges(n, 3), *zero_ranges(n, 7), (1, n - 1), (n // 2, n // 2)]:
            runs = tp_ranges.runs(s, a, b)
            positions = torch.cat([torch.arange(l, l + k) for l, _, k in runs] or [torch.zeros(0, dtype=torch.long)])
            expected = torch.arange(a, b)[local[a:b] != 0]
            assert torch.equal(positions, expected)
            for l, g, k in runs:
                assert torch.equal(local[l : l + k], torch.arange(g + 1, g + k + 1, dtype=torch.float32))


def test_row_split_runs_are_one_per_row():
    s = shard("row", 1, 2)  # (5, 8) split along dim 1: rank 1 holds columns 4..7
    assert tp_ranges.runs(s, 0, 20) == [(4 * r, 8 * r + 4, 4) for r in range(5)]
    assert tp_ranges.runs(s, 6, 13) == [(6, 14, 2), (8, 20, 4), (12, 28, 1)]


def test_fused_pieces_and_padding():
    s = shard("fused", 1, 2)  # rank 1: [q_1 | k_1 | v_1], 2 rows of 4 each
    assert tp_ranges.runs(s, 0, 24) == [(0, 8, 8), (8, 24, 8), (16, 40, 8)]
    v = shard("vocab", 3, 4)  # 13 rows over 4: local 4 rows, rank 3 holds row 12 only
    assert v.pieces == ((0, 12, 1),) and tp_ranges.runs(v, 0, 16) == [(0, 48, 4)]
    assert tp_ranges.runs(v, 4, 16) == []  # all padding


def test_coalesce_bounds_reads():
    copies = [(0, 0, 2), (2, 3, 2), (4, 10, 2), (6, 12, 9)]
    assert tp_ranges.coalesce(copies, gap=1, limit=100) == [
        (0, 5, copies[:2]), (10, 21, copies[2:])]
    assert [(lo, hi) for lo, hi, _ in tp_ranges.coalesce(copies, gap=100, limit=6)] == [
        (0, 5), (10, 12), (12, 21)]


# -- resharding through real files -----------------------------------------------------------------
PAIRS = [(a, b) for a, b in itertools.product(LAYOUTS, LAYOUTS) if a != b or a[0] > 1]


RESHARDS = [(c, a, b) for c in CASES for a, b in PAIRS if _fits(c, a[0], b[0])]


@pytest.mark.parametrize("case,saved,loaded", RESHARDS,
                         ids=[f"{c}-tp{a}dp{b}-to-tp{x}dp{y}" for c, (a, b), (x, y) in RESHARDS])
def test_every_layout_loads_every_other(tmp_path, monkeypatch, case, saved, loaded):
    monkeypatch.setattr(reshard, "READ_GAP", 3)  # several reads per range, some coalesced
    monkeypatch.setattr(reshard, "READ_LIMIT", 11)
    store = saved_checkpoint(tmp_path, case, *saved)
    tp, dp = loaded
    for t in range(tp):
        s = shard(case, t, tp)
        flat = local_of(case, s).view(-1)  # what this rank must end up with (padding zero)
        for a, b in zero_ranges(flat.numel(), dp):
            out = torch.full((b - a,), float("nan"))
            store.fill(case, "master", a, b, out, shard=s)
            assert torch.equal(out, flat[a:b]), (t, a, b)
    whole = torch.empty(CASES[case][0])
    store.fill(case, "master", 0, whole.numel(), whole)  # consolidation
    assert torch.equal(whole, full_of(case))


def test_loaded_in_another_split_dimension(tmp_path):
    """A checkpoint split along dim 0 loads into a model split along dim 1."""
    store = saved_checkpoint(tmp_path, "column", 2, 2)
    full = full_of("column")
    for t in range(3):
        s = TPShard(1, (8, 6), ((0, 2 * t, 2),), 2, t, 3)
        out = torch.empty(16)
        store.fill("column", "master", 0, 16, out, shard=s)
        assert torch.equal(out.view(8, 2), full[:, 2 * t : 2 * t + 2])


def test_reads_only_what_is_needed(tmp_path, monkeypatch):
    """A column split read at the same split reads each element once; the tp=1 whole tensor
    read by a dim-1 piece reads at most a bounded superset."""
    read = []
    original = reshard.TensorFile.read_into

    def counting(self, name, start, end, out):
        read.append(end - start)
        return original(self, name, start, end, out)

    monkeypatch.setattr(reshard.TensorFile, "read_into", counting)
    (tmp_path / "a").mkdir()
    store = saved_checkpoint(tmp_path / "a", "column", 2, 1)
    s = shard("column", 1, 2)
    store.fill("column", "master", 0, 24, torch.empty(24), shard=s)
    assert read == [24]
    read.clear()
    (tmp_path / "b").mkdir()
    store = saved_checkpoint(tmp_path / "b", "row", 1, 1)
    monkeypatch.setattr(reshard, "READ_LIMIT", 16)
    store.fill("row", "master", 0, 20, torch.empty(20), shard=shard("row", 0, 2))
    assert sum(read) <= 20 + 4 * 4 and max(read) <= 16, read


def test_padding_is_never_saved(tmp_path):
    store = saved_checkpoint(tmp_path, "vocab", 4, 1)
    sizes = [store.file(r["file"]).entry("master/vocab").numel for r in store.meta["params"]["vocab"]["ranges"]]
    assert sizes == [16, 16, 16, 4] and sum(sizes) == 13 * 4


def test_coverage_errors_are_one_line(tmp_path):
    store = saved_checkpoint(tmp_path, "fused", 2, 2)
    meta = store.meta
    ranges = meta["params"]["fused"]["ranges"]
    dropped = {"params": {"fused": {**meta["params"]["fused"],
                                    "ranges": [r for r in ranges if r["tp"]["tp_rank"] == 0]}}}
    with pytest.raises(CheckpointError, match="tensor-parallel pieces cover") as err:
        check_coverage(dropped)
    assert "\n" not in str(err.value)
    holed = {"params": {"fused": {**meta["params"]["fused"], "ranges": ranges[1:]}}}
    with pytest.raises(CheckpointError, match="tp rank 0's piece"):
        check_coverage(holed)
    wrong = {"params": {"fused": {**meta["params"]["fused"], "shape": [12, 5]}}}
    with pytest.raises(CheckpointError, match="differing shards|shape"):
        check_coverage(wrong)
