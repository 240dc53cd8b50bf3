"""Pruning masks, and the cuts `redundancy_clean` makes with them.

Four kinds, each a 0/1 mask broadcast against the weight (shapes for a Linear weight
(out, in) and a Conv2d weight (out, in, kh, kw)):

    sparse   (out, in) / (out, in, kh, kw)  single weights
    row      (out, 1)                       output rows of a Linear (and their bias)
    head     (1, num_heads)                 column blocks of an attention output matrix:
                                            head h owns input columns [h·d, (h+1)·d)
    channel  (out, 1, 1, 1)                 output channels of a Conv2d (and their bias)

A mask keeps the ceil(dense_ratio · n) highest-scoring entries. "l1" scores are the
weight's magnitudes (summed over the row / head / channel), taken once when
`init_compression` runs, as DeepSpeed does; "topk" scores are learnt parameters: the mask
is their top-k, and the mask's gradient passes straight to them (Sanh et al. 2020,
movement pruning, https://arxiv.org/abs/2005.07683; DeepSpeed's TopKBinarizer).
"""

from __future__ import annotations

import math

import torch
from torch import nn

# technique -> (buffer holding an l1 mask, parameter holding topk scores): DeepSpeed's names
MASK_NAMES = {
    "sparse_pruning": ("sparse_pruning_mask", "sparse_mask_scores"),
    "row_pruning": ("row_pruning_mask", "row_mask_scores"),
    "head_pruning": ("head_pruning_mask", "head_pruning_scores"),
    "channel_pruning": ("channel_pruning_mask", "channel_mask_scores"),
}


@torch.no_grad()
def top_mask(scores: torch.Tensor, dense_ratio: float) -> torch.Tensor:
    """1 at the ceil(dense_ratio · numel) largest scores, 0 elsewhere; scores' shape/dtype."""
    keep = math.ceil(dense_ratio * scores.numel())
    mask = torch.zeros_like(scores)
    mask.view(-1)[scores.flatten().topk(keep).indices] = 1
    return mask


class _TopK(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scores: torch.Tensor, dense_ratio: float) -> torch.Tensor:
        return top_mask(scores, dense_ratio)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def learnt_mask(scores: torch.Tensor, dense_ratio: float) -> torch.Tensor:
    """`top_mask` whose gradient reaches `scores` unchanged (straight through)."""
    return _TopK.apply(scores, dense_ratio)


def score_shape(technique: str, weight: torch.Tensor, num_heads: int | None = None) -> tuple:
    return {
        "sparse_pruning": tuple(weight.shape),
        "row_pruning": (weight.shape[0], 1),
        "head_pruning": (1, num_heads),
        "channel_pruning": (weight.shape[0], 1, 1, 1),
    }[technique]


@torch.no_grad()
def magnitude(technique: str, weight: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
    """The l1 score of each prunable unit, shaped as the mask."""
    w = weight.abs()
    if technique == "sparse_pruning":
        return w
    if technique == "row_pruning":
        return w.sum(dim=1, keepdim=True)
    if technique == "head_pruning":
        return w.reshape(w.shape[0], num_heads, -1).sum(dim=(0, 2)).view(1, num_heads)
    return w.sum(dim=(1, 2, 3)).view(-1, 1, 1, 1)


def init_scores(shape: tuple, like: torch.Tensor) -> nn.Parameter:
    """topk scores, initialised as DeepSpeed does (Kaiming uniform, a = sqrt(5))."""
    scores = torch.empty(shape, device=like.device, dtype=like.dtype)
    nn.init.kaiming_uniform_(scores, a=math.sqrt(5))
    return nn.Parameter(scores)


def mask_heads(weight: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """An output matrix (out, heads·d) with the input columns of masked heads zeroed."""
    out, heads = weight.shape[0], mask.numel()
    return (weight.reshape(out, heads, -1) * mask.reshape(1, heads, 1)).reshape(weight.shape)


# -- the cuts: new, smaller tensors -----------------------------------------------------------
def keep_rows(t: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Rows (dim 0) where `keep` is true: output rows, conv output channels, BN features."""
    return t[keep].contiguous()


def keep_columns(t: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Dim 1 where `keep` is true: a Linear's input columns, a Conv2d's input channels."""
    return t[:, keep].contiguous()


def keep_head_rows(t: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Q/K/V weight (heads·d, in) or bias (heads·d,): the rows of the kept heads."""
    heads = keep.numel()
    return t.reshape(heads, -1, *t.shape[1:])[keep].reshape(-1, *t.shape[1:]).contiguous()


def keep_head_columns(t: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Output matrix (out, heads·d): the input columns of the kept heads."""
    out, heads = t.shape[0], keep.numel()
    return t.reshape(out, heads, -1)[:, keep].reshape(out, -1).contiguous()
