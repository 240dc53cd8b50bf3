"""Cutting a batch for context parallelism (meshspeed/sequence/data.py), on one process
with a stand-in for the cp group: what each rank keeps, the labels shifted before the
cut, injected global positions, and the loss weights that make dp x cp averaging exact."""

from types import SimpleNamespace

import pytest
import torch

from meshspeed.config.context_parallel import ContextParallelConfig
from meshspeed.sequence.data import IGNORE, cut_batch
from meshspeed.sequence.groups import hybrid_layouts


class _Ctx:
    """ContextParallel's data-side half, without process groups."""

    def __init__(self, degree, rank, balanced):
        from meshspeed.sequence.context import ContextParallel

        self.degree, self.rank, self.balanced, self.seq_dim = degree, rank, balanced, 1
        self.layout = self.positions = self.max_positions = None
        self.set_sequence = ContextParallel.set_sequence.__get__(self)


class _GPTLike(torch.nn.Module):
    def forward(self, idx, targets=None):
        return idx


class _HFLike(torch.nn.Module):
    loss_type = "ForCausalLM"

    def forward(self, input_ids=None, labels=None, position_ids=None, shift_labels=None, attention_mask=None):
        return input_ids


def test_balanced_cut_keeps_chunks_i_and_2cp_minus_1_minus_i():
    ids = torch.arange(16).view(1, 16)
    targets = ids + 100
    kept = []
    for rank in range(4):
        (x, t), _, w = cut_batch(_Ctx(4, rank, True), _GPTLike(), (ids, targets), {})
        assert torch.equal(t, x + 100)  # targets cut with their inputs
        assert (w.local, w.total) == (4, 16)
        kept.append(x.flatten().tolist())
    assert kept == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]


def test_hf_labels_are_shifted_over_the_whole_sequence_before_the_cut():
    ids = torch.arange(8).view(1, 8)
    pieces = []
    for rank in range(2):
        ctx = _Ctx(2, rank, True)
        _, kw, w = cut_batch(ctx, _HFLike(), (), {"input_ids": ids, "labels": ids,
                                                  "attention_mask": torch.ones(1, 8)})
        assert "attention_mask" not in kw  # all ones: dropped
        assert torch.equal(kw["position_ids"][0], ctx.positions)  # global positions injected
        assert torch.equal(kw["shift_labels"][kw["shift_labels"] != IGNORE],
                           (kw["input_ids"] + 1)[kw["shift_labels"] != IGNORE])
        pieces.append((w.local, w.total))
    # 7 labelled tokens (the last has no successor); rank 0 holds the last chunk
    assert pieces == [(3, 7), (4, 7)]


def test_user_position_ids_are_cut_not_replaced():
    ids = torch.arange(8).view(1, 8)
    _, kw, _ = cut_batch(_Ctx(2, 1, False), _HFLike(), (), {"input_ids": ids, "position_ids": ids + 50})
    assert kw["position_ids"].tolist() == [[54, 55, 56, 57]]


def test_padding_mask_and_uneven_length_are_errors():
    ids = torch.arange(8).view(1, 8)
    mask = torch.ones(1, 8)
    mask[0, -2:] = 0
    with pytest.raises(ValueError, match="pack the sequences"):
        cut_batch(_Ctx(2, 0, True), _HFLike(), (), {"input_ids": ids, "attention_mask": mask})
    with pytest.raises(ValueError, match="not divisible by 2 x degree = 4"):
        cut_batch(_Ctx(2, 0, True), _GPTLike(), (torch.arange(6).view(1, 6),), {})


def test_hybrid_groups_all_to_all_consecutive_ring_strided():
    ulysses, ring = hybrid_layouts([[0, 1, 2, 3], [4, 5, 6, 7]], 2)
    assert ulysses == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert ring == [[0, 2], [1, 3], [4, 6], [5, 7]]


@pytest.mark.parametrize("mode, heads, kv, says", [
    ("ulysses", 6, 6, "6 attention heads per rank are not divisible by Ulysses degree 4"),
    ("ulysses", 8, 3, "3 key/value heads per rank"),
    ("hybrid", 2, 2, "ulysses_size 4"),
])
def test_heads_the_all_to_all_cannot_split(mode, heads, kv, says):
    from meshspeed.sequence.context import ContextParallel

    section = ContextParallelConfig(size=8 if mode == "hybrid" else 4, mode=mode,
                                    ulysses_size=4 if mode == "hybrid" else None)
    ctx = SimpleNamespace(mode=section.mode, ulysses_size=section.all_to_all_size)
    with pytest.raises(ValueError, match=says):
        ContextParallel.check_heads(ctx, heads, kv, "layers.0.attn")
