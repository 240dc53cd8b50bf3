"""Vocab-parallel embedding, tied lm_head and cross-entropy against nn.Embedding and
F.cross_entropy on one process: padded vocabularies, padding_idx, ignore_index, sequence
parallelism; and no tensor with the whole vocabulary's width on any rank. fp32, rtol 1e-5."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode

from meshspeed import comm
from meshspeed.tensor_parallel.layers import (
    ColumnParallelLinear,
    VocabParallelCrossEntropy,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from meshspeed.testing import run_distributed, world_sizes
from tests.tensor_parallel._reference import ATOL, RTOL, assert_shard_matches, seq_shard

B, T, E = 2, 4, 6


def _ids(vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def _check_embedding(vocab: int, sp: bool, padding_idx=None):
    torch.manual_seed(7)
    ref = nn.Embedding(vocab, E, padding_idx=padding_idx)
    layer = VocabParallelEmbedding.from_module(ref, None, sequence_parallel=sp)
    shard = layer.tp_shards["weight"]
    assert layer.num_embeddings == vocab and layer.vocab_end - layer.vocab_start == shard.held
    ids = _ids(vocab, 8)
    if padding_idx is not None:
        ids[0, :2] = padding_idx
    W = torch.randn(B, T, E, generator=torch.Generator().manual_seed(9))
    ref_out = ref(ids)
    (ref_out * W).sum().backward()
    out = layer(ids)
    if sp:
        assert_close(out, seq_shard(ref_out.detach()), rtol=RTOL, atol=ATOL)
        (out * seq_shard(W)).sum().backward()
    else:
        assert_close(out, ref_out, rtol=RTOL, atol=ATOL)
        (out * W).sum().backward()
    assert_shard_matches(layer.weight.grad, shard, ref.weight.grad)


def _check_cross_entropy(vocab: int, ignore: bool, reduction: str, dtype=torch.float32):
    g = torch.Generator().manual_seed(10)
    logits = (torch.randn(B, T, vocab, generator=g) * 3).to(dtype)
    target = _ids(vocab, 11)
    if ignore:
        target[0, 1:3] = -100
    ref_logits = logits.clone().requires_grad_()
    ref_loss = F.cross_entropy(ref_logits.float().flatten(0, 1), target.flatten(), reduction=reduction)
    ref_loss = ref_loss.view(B, T) if reduction == "none" else ref_loss
    (ref_loss * (torch.arange(B * T).view(B, T) + 1 if reduction == "none" else 1)).sum().backward()

    n, r = comm.get_world_size(), comm.get_rank()
    per_rank = -(-vocab // n)
    start = min(vocab, r * per_rank)
    padded = torch.cat([logits, torch.zeros(B, T, per_rank * n - vocab, dtype=dtype)], -1)
    local = padded[..., start:start + per_rank] if start < vocab else padded[..., -per_rank:]
    local = local.clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, None, vocab_start=r * per_rank,
                                        vocab_size=vocab, reduction=reduction)
    tol = {"rtol": RTOL, "atol": ATOL} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    assert_close(loss, ref_loss.detach(), **tol)
    (loss * (torch.arange(B * T).view(B, T) + 1 if reduction == "none" else 1)).sum().backward()
    want = torch.cat([ref_logits.grad, torch.zeros(B, T, per_rank * n - vocab, dtype=dtype)], -1)
    assert local.grad.dtype == dtype
    assert_close(local.grad, want[..., r * per_rank:(r + 1) * per_rank], **tol)


def _vocab_body():
    n = comm.get_world_size()
    for sp in (False, True):
        _check_embedding(8 * n, sp)
        _check_embedding(8 * n + 1, sp)  # padded vocabulary
        _check_embedding(8 * n + 1, sp, padding_idx=3)
    for vocab in (4 * n, 4 * n - 1):
        for ignore in (False, True):
            for reduction in ("mean", "sum", "none"):
                _check_cross_entropy(vocab, ignore, reduction)
    _check_cross_entropy(4 * n - 1, True, "mean", dtype=torch.bfloat16)
    module = VocabParallelCrossEntropy(None, vocab_start=0, vocab_size=4 * n)
    assert module.reduction == "mean"
    return True


@world_sizes(2, 4)
def test_embedding_and_cross_entropy_match_one_process(world_size):
    assert all(run_distributed(_vocab_body, world_size))


class _WidestTensor(TorchDispatchMode):
    """Records the largest last dimension of any tensor an op produces."""

    def __init__(self) -> None:
        super().__init__()
        self.widths: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim():
                self.widths.add(t.shape[-1])
        return out


def _tied_head_body(sp: bool):
    """Embedding -> tied vocab-parallel lm_head -> vocab-parallel CE equals the one-process
    tied model, keeps one Parameter, and never makes a (.., vocab) tensor."""
    n = comm.get_world_size()
    vocab = 8 * n + 3  # padded; no other dimension of the test equals it
    torch.manual_seed(12)
    ref_emb = nn.Embedding(vocab, E)
    emb = VocabParallelEmbedding.from_module(ref_emb, None, sequence_parallel=sp)
    head = ColumnParallelLinear.tied_to(emb, sequence_parallel=sp)
    assert head.weight is emb.weight and head.tp_shards["weight"] == emb.tp_shards["weight"]
    assert len(list(nn.ModuleList([emb, head]).parameters())) == 1
    ids, target = _ids(vocab, 13), _ids(vocab, 14)
    target[1, 0] = -100

    ref_logits = F.linear(ref_emb(ids), ref_emb.weight)
    ref_loss = F.cross_entropy(ref_logits.flatten(0, 1), target.flatten())
    ref_loss.backward()

    with _WidestTensor() as seen:
        logits = head(emb(ids))
        loss = vocab_parallel_cross_entropy(logits, target, None, vocab_start=emb.vocab_start,
                                            vocab_size=vocab)
        loss.backward()
    assert vocab not in seen.widths, sorted(seen.widths)
    assert_close(loss, ref_loss.detach(), rtol=RTOL, atol=ATOL)
    assert_shard_matches(emb.weight.grad, emb.tp_shards["weight"], ref_emb.weight.grad)
    return True


@world_sizes(2, 4)
def test_tied_head_and_loss_never_hold_the_whole_vocabulary(world_size):
    for sp in (False, True):
        assert all(run_distributed(_tied_head_body, world_size, args=(sp,)))
