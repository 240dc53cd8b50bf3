"""The data path under context parallelism: every cp rank of a data-parallel group reads
the same samples (the loader splits over dp only); the engine cuts each batch so that the
rank keeps its tokens, and weights the loss so that averaging gradients over dp x cp is
the gradient of the loss over all tokens.

Note [cutting a batch for context parallelism]
What is cut: every tensor argument (positional, keyword, or one level inside a dict
argument) whose `seq_dim` (batch-first: 1) is the sequence length, taken from the first
such tensor; other tensors pass whole. Three arguments are special:

* `labels` of a Hugging Face causal LM: the model shifts them by one inside its loss, and
  a shift inside a rank's piece would pair a token with the wrong successor at every
  chunk boundary. So the labels are shifted over the whole sequence first and handed to
  the model as `shift_labels` (which its loss takes instead of shifting); `labels` stays
  non-None so the loss is computed. meshspeed's GPT takes targets already shifted.
* `position_ids`: cut like the rest when given (they are the user's global positions);
  when the model's forward takes them and they are not given, the global positions of
  this rank's tokens are passed. meshspeed's GPT reads them from the ContextParallel.
* `attention_mask`: all ones is dropped (the attention is causal over global positions);
  a padding mask is an error: pack the sequences instead.

The loss: a model returns the mean over its rank's n_r labelled tokens, l_r. The engine
returns l_r · cp · n_r / N (N: labelled tokens of the whole sequences, known on every rank
before cutting), whose average over the cp ranks is the mean over all N tokens, so the
gradient average over dp x cp is exact even when the ranks hold different numbers of
labelled tokens (the shift leaves the last token unlabelled; ignore_index -100 anywhere).
Its value is replaced by that average (one scalar all-reduce over cp), so every rank
reports the loss of the whole sequences.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

from meshspeed import comm

IGNORE = -100


@dataclass
class LossWeight:
    local: int  # labelled tokens on this rank
    total: int  # labelled tokens of the whole sequences (every cp rank knows it)


def _is_hf_causal_lm(module: torch.nn.Module) -> bool:
    return getattr(module, "loss_type", None) == "ForCausalLM"


def _takes(module: torch.nn.Module, name: str) -> bool:
    try:
        return name in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


def _first_sequence(args: tuple, kwargs: dict, dim: int) -> torch.Tensor | None:
    for name in ("input_ids", "inputs_embeds"):
        if isinstance(kwargs.get(name), torch.Tensor):
            return kwargs[name]
    values = list(args) + list(kwargs.values())
    values += [v for d in values if isinstance(d, dict) for v in d.values()]
    for v in values:
        if isinstance(v, torch.Tensor) and v.dim() > dim:
            return v
    return None


def cut_batch(ctx, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict, LossWeight | None]:
    """This rank's part of one batch, and the loss weighting (None when no labels were
    found: the loss is then taken as the mean over equally many tokens on every rank)."""
    dim = ctx.seq_dim
    first = _first_sequence(args, kwargs, dim)
    if first is None:
        raise ValueError("context parallelism: no tensor argument with a sequence dimension "
                         f"(dim {dim}) to cut; pass token ids shaped (batch, seq) or set "
                         "context_parallel.seq_dim")
    seq_len = first.size(dim)
    layout = ctx.set_sequence(seq_len, first.device)
    hf_lm = _is_hf_causal_lm(module)
    weight: list[LossWeight] = []

    def cut(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.dim() > dim and x.size(dim) == seq_len:
            return layout.shard(x, ctx.rank, dim)
        return x

    def labelled(full: torch.Tensor) -> None:
        weight.append(LossWeight(int((layout.shard(full, ctx.rank, dim) != IGNORE).sum()),
                                 int((full != IGNORE).sum())))

    kwargs = dict(kwargs)
    mask = kwargs.pop("attention_mask", None)
    if mask is not None and not bool(mask.bool().all()):
        raise ValueError("context parallelism: attention_mask has padding (zeros); the sequence is "
                         "split over ranks with a causal mask over global positions, so pack the "
                         "sequences to the full length instead of padding them")
    labels = kwargs.get("labels")
    if hf_lm and isinstance(labels, torch.Tensor) and "shift_labels" not in kwargs:
        shifted = torch.nn.functional.pad(labels, (0, 1), value=IGNORE)[..., 1:]
        kwargs["shift_labels"] = shifted
    for name in ("shift_labels", "labels", "targets"):
        if isinstance(kwargs.get(name), torch.Tensor) and not weight:
            labelled(kwargs[name])
    if not weight and len(args) > 1 and isinstance(args[1], torch.Tensor) and args[1].shape == first.shape \
            and not args[1].is_floating_point():
        labelled(args[1])  # (ids, targets), meshspeed's GPT and most hand-written LMs
    inject = "position_ids" not in kwargs and _takes(module, "position_ids")
    args = tuple({k: cut(v) for k, v in a.items()} if isinstance(a, dict) else cut(a) for a in args)
    kwargs = {k: cut(v) for k, v in kwargs.items()}
    if inject:
        kwargs["position_ids"] = ctx.positions.unsqueeze(0).expand(first.size(0), -1)
    return args, kwargs, (weight[0] if weight else None)


def weigh_loss(ctx, out: Any, weight: LossWeight | None) -> Any:
    """The model's output with its loss weighted and reported as described in
    Note [cutting a batch for context parallelism]."""
    loss = out if isinstance(out, torch.Tensor) else getattr(out, "loss", None)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        return out
    if weight is not None and weight.total > 0:
        scaled = loss * (ctx.degree * weight.local / weight.total)
    else:
        scaled = loss
    mean = scaled.detach().clone()
    comm.all_reduce(mean, group=ctx.group, op="avg")
    reported = scaled + (mean - scaled.detach())
    if isinstance(out, torch.Tensor):
        return reported
    out["loss"] = reported
    return out
