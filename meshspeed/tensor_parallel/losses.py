"""The plan's "loss" kind: a model's cross-entropy swapped for the vocab-parallel one.

With a vocab_head every rank holds logits for its own slice of the vocabulary only; the
vocab-parallel cross-entropy (Megatron-LM, arXiv:1909.08053 section 3) finds the softmax
normaliser and the target logit with two small all-reduces over tp, so the (tokens, vocab)
logits are never gathered. Two places a model computes its loss:

* a module (the reference GPT's `loss_fn = nn.CrossEntropyLoss()`), called as
  `loss_fn(logits (N, vocab), targets (N,))`: replaced by `VocabParallelCrossEntropy`;
* Hugging Face's `PreTrainedModel.loss_function` (a property with a setter, transformers
  4.46+): overridden by `hf_causal_lm_loss`, which shifts the labels as HF's
  `ForCausalLMLoss` does.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from meshspeed.tensor_parallel.layers import VocabParallelCrossEntropy, vocab_parallel_cross_entropy
from meshspeed.tensor_parallel.plan import HF_LOSS


def vocab_range(head: nn.Module) -> tuple[int, int]:
    """(first vocabulary id this rank's logits cover, logical vocabulary size)."""
    shard = head.tp_shards["weight"]
    return shard.pieces[0][1], shard.logical_shape[shard.dim]


class HFCausalLMLoss:
    """HF's ForCausalLMLoss contract (logits, labels, vocab_size, num_items_in_batch,
    ignore_index, shift_labels) on vocab-sharded logits."""

    def __init__(self, group: Any, vocab_start: int, vocab_size: int):
        self.group, self.vocab_start, self.vocab_size = group, vocab_start, vocab_size

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, vocab_size: int | None = None,
                 num_items_in_batch: torch.Tensor | int | None = None, ignore_index: int = -100,
                 shift_labels: torch.Tensor | None = None, **_: Any) -> torch.Tensor:
        if shift_labels is None:  # tokens < n predict n; the last position predicts nothing
            labels = nn.functional.pad(labels, (0, 1), value=ignore_index)
            shift_labels = labels[..., 1:]
        shift_labels = shift_labels.reshape(-1).to(logits.device)
        flat = logits.float().reshape(shift_labels.numel(), -1)
        reduction = "mean" if num_items_in_batch is None else "sum"
        loss = vocab_parallel_cross_entropy(
            flat, shift_labels, self.group, vocab_start=self.vocab_start,
            vocab_size=self.vocab_size, ignore_index=ignore_index, reduction=reduction)
        if num_items_in_batch is not None:
            if torch.is_tensor(num_items_in_batch):
                num_items_in_batch = num_items_in_batch.to(loss.device)
            loss = loss / num_items_in_batch
        return loss


def install_loss(model: nn.Module, name: str, head: nn.Module, group: Any) -> None:
    """Swap the loss at `name` (a module path, or HF's `loss_function`)."""
    start, size = vocab_range(head)
    if name == HF_LOSS:
        model.loss_function = HFCausalLMLoss(group, start, size)
        return
    old = model.get_submodule(name)
    new = VocabParallelCrossEntropy(group, vocab_start=start, vocab_size=size,
                                    ignore_index=old.ignore_index, reduction=old.reduction)
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
