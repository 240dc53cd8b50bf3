"""Cross-entropy on vocab-parallel logits, never holding the whole vocabulary's logits
(Megatron-LM, arXiv:1909.08053, section 3: "fuse the output GEMM with the cross-entropy
loss, which reduces the dimension to the batch size").

Note [vocab-parallel cross-entropy]
Rank r holds logits z[..., v] for v in [vocab_start, vocab_start + V_r) (padded columns,
beyond the logical vocab_size, are set to -inf so they count for nothing). With
m = max_v z (an all-reduce MAX; a constant shift, no gradient),

    loss = log sum_v exp(z_v - m) - (z_target - m)

and both sums over v are over all ranks: one all-reduce SUM carries [sum-exp, target
logit] together (the target logit is non-zero on the owning rank only). Backward is
local: d loss / d z_v = softmax_v - [v == target], times the incoming gradient (divided
by the count of non-ignored targets for "mean", as F.cross_entropy does). The math is in
fp32 whatever the logits' dtype; the gradient comes back in the logits' dtype. Saved for
backward: the fp32 local softmax (V_r per token).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from meshspeed.comm.collectives import all_reduce


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group: Any, vocab_start: int, vocab_size: int,
                ignore_index: int, reduction: str):
        local_v = logits.shape[-1]
        z = logits.float()
        columns = torch.arange(local_v, device=z.device) + vocab_start
        if int(columns[-1]) >= vocab_size:  # padded columns (Note [vocab-parallel cross-entropy])
            z = z.masked_fill(columns >= vocab_size, float("-inf"))
        m = z.max(dim=-1).values
        all_reduce(m, group=group, op="max")
        z = z - m.unsqueeze(-1)
        kept = target != ignore_index
        t_local = target - vocab_start
        owned = kept & (t_local >= 0) & (t_local < local_v)
        picked = z.gather(-1, t_local.clamp(0, local_v - 1).unsqueeze(-1)).squeeze(-1)
        exp = z.exp()
        sums = torch.stack([exp.sum(dim=-1), torch.where(owned, picked, torch.zeros_like(picked))])
        all_reduce(sums, group=group)
        sum_exp, target_logit = sums[0], sums[1]
        per_token = torch.where(kept, sum_exp.log() - target_logit, torch.zeros_like(sum_exp))
        exp.div_(sum_exp.unsqueeze(-1))  # now the local softmax
        ctx.save_for_backward(exp, t_local, owned, kept)
        ctx.reduction, ctx.dtype = reduction, logits.dtype
        if reduction == "none":
            return per_token
        if reduction == "sum":
            return per_token.sum()
        ctx.count = int(kept.sum())
        return per_token.sum() / ctx.count  # nan with no target kept, like F.cross_entropy

    @staticmethod
    def backward(ctx, grad):
        softmax, t_local, owned, kept = ctx.saved_tensors
        if ctx.reduction == "mean":
            grad = grad / ctx.count
        scale = torch.where(kept, grad.float().expand(kept.shape), torch.zeros((), device=grad.device))
        g = softmax * scale.unsqueeze(-1)  # then minus scale at the owned target column
        g.scatter_add_(-1, t_local.clamp(0, g.shape[-1] - 1).unsqueeze(-1),
                       -(scale * owned).unsqueeze(-1))
        return g.to(ctx.dtype), None, None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group: Any, *,
                                 vocab_start: int, vocab_size: int, ignore_index: int = -100,
                                 reduction: str = "mean") -> torch.Tensor:
    """F.cross_entropy(whole logits, target) from this rank's vocabulary slice.

    logits (..., V_r): logits for vocabulary ids [vocab_start, vocab_start + V_r) (columns
    at or beyond the logical `vocab_size` are padding); target (...): ids in the whole
    vocabulary, or ignore_index. reduction: "mean" (over non-ignored targets), "sum",
    "none". Note [vocab-parallel cross-entropy]."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if target.shape != logits.shape[:-1]:
        raise ValueError(f"target shape {tuple(target.shape)} does not match logits "
                         f"{tuple(logits.shape)} without the vocabulary dim")
    return _VocabParallelCE.apply(logits, target, group, vocab_start, vocab_size, ignore_index,
                                  reduction)


class VocabParallelCrossEntropy(nn.Module):
    """vocab_parallel_cross_entropy as a module: forward(logits, target), mean reduction
    unless `reduction` says otherwise."""

    def __init__(self, group: Any, *, vocab_start: int, vocab_size: int, ignore_index: int = -100,
                 reduction: str = "mean") -> None:
        super().__init__()
        self.group, self.vocab_start, self.vocab_size = group, vocab_start, vocab_size
        self.ignore_index, self.reduction = ignore_index, reduction

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, target, self.group, vocab_start=self.vocab_start,
                                            vocab_size=self.vocab_size,
                                            ignore_index=self.ignore_index, reduction=self.reduction)

    def extra_repr(self) -> str:
        return f"vocab from {self.vocab_start} of {self.vocab_size}, reduction={self.reduction}"
