"""Compressed Linear / Conv2d / Embedding: the torch layer plus the state of its techniques.

A wrapper is the same layer with the same `weight` and `bias` Parameter objects (so an
optimizer built before or after, and checkpoints of the weights, keep working); it adds
only what the techniques need, under DeepSpeed's names: l1 masks as buffers
(`sparse_pruning_mask`, ...), topk scores as parameters (`sparse_mask_scores`, ...), the
static activation range (`activation_quantizer.x_min_max`). The forward computes with the
quantized / masked weight; the stored weight stays in full precision.

Each technique has a lifecycle (`Phase`): WAITING until its schedule_offset, ACTIVE from
then on (the scheduler moves it), FIXED once `redundancy_clean` wrote its effect into the
weights. Forward order: weight quantization, sparse mask, row / head / channel mask, then
activation quantization of the input, as in DeepSpeed.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from meshspeed.compression.prune import (
    MASK_NAMES,
    init_scores,
    learnt_mask,
    magnitude,
    mask_heads,
    score_shape,
    top_mask,
)
from meshspeed.compression.quantize import (
    moq_bits,
    moq_real_share,
    quantize,
    quantize_uniform,
    straight_through,
)

log = logging.getLogger("meshspeed")


class Phase(enum.Enum):
    WAITING = "waiting"  # before schedule_offset: the layer computes as if uncompressed
    ACTIVE = "active"  # applied in every forward
    FIXED = "fixed"  # written into the weights by redundancy_clean; nothing left to apply


@dataclass
class Technique:
    name: str  # the config key: "weight_quantization", "row_pruning", ...
    offset: int  # schedule_offset: the optimizer step from which it applies
    phase: Phase = Phase.WAITING

    def at_step(self, step: int) -> None:
        """The scheduler's count of optimizer steps taken; starts the technique at its offset."""
        if self.phase is Phase.WAITING and step >= self.offset:
            self.phase = Phase.ACTIVE

    def fix(self) -> None:
        assert self.phase is not Phase.FIXED, f"{self.name} was already written into the weights"
        self.phase = Phase.FIXED


@dataclass
class WeightQuant(Technique):
    start_bits: int = 8
    target_bits: int = 8
    period: int = 1  # quantization_period
    groups: int = 1  # scales per weight
    symmetric: bool = True
    stochastic: bool = False  # rounding "stochastic" (training forwards only)
    in_forward: bool = False  # quantize_weight_in_forward: target_bits at once, no schedule
    change: float | None = None  # fp16_mixed_quantize.quantize_change_ratio when enabled
    verbose: bool = False
    count: int = 0  # quantizations so far (DeepSpeed's qsteps): step - offset + 1

    def at_step(self, step: int) -> None:
        super().at_step(step)
        if self.phase is Phase.ACTIVE:
            before, self.count = self.bits, step - self.offset + 1
            if self.verbose and self.bits != before:
                log.info("weight quantization: %d -> %d bits at step %d", before, self.bits, step)

    @property
    def bits(self) -> int:
        """The bit width the forward uses now (DeepSpeed's MoQ rule; see quantize.moq_bits)."""
        if self.in_forward:
            return self.target_bits
        return moq_bits(self.count, self.start_bits, self.target_bits, self.period) if self.count else self.start_bits

    @property
    def real_share(self) -> float:
        """fp16_mixed_quantize: the share of the unquantized weight mixed in (0: none)."""
        if self.change is None or self.in_forward or not self.count:
            return 0.0
        return moq_real_share(self.count, self.start_bits, self.target_bits, self.period, self.change)

    def apply(self, weight: torch.Tensor, training: bool) -> torch.Tensor:
        w = weight.detach()
        q = quantize(w, self.bits, self.groups, self.symmetric, self.stochastic and training)
        share = self.real_share
        if share:
            q = share * w + (1 - share) * q
        return straight_through(weight, q)


@dataclass
class Prune(Technique):
    method: str = "l1"  # "l1": magnitudes at init_compression; "topk": learnt scores
    dense_ratio: float = 1.0
    num_heads: int | None = None  # head pruning


@dataclass
class ActivationQuant(Technique):
    bits: int = 8
    symmetric: bool = True
    static: bool = False  # range_calibration "static": one running range, not one per token


class StaticRange(nn.Module):
    """A running min/max of the inputs (momentum 0.95), updated in training forwards."""

    def __init__(self, momentum: float = 0.95, device=None):
        super().__init__()
        self.momentum = momentum
        self.register_buffer("x_min_max", torch.zeros(2, device=device))

    def forward(self, x: torch.Tensor, bits: int, symmetric: bool) -> torch.Tensor:
        if self.training:
            seen = torch.stack([x.detach().min(), x.detach().max()]).to(self.x_min_max.dtype)
            if self.x_min_max[0] == self.x_min_max[1]:  # first batch: start from its range
                self.x_min_max.copy_(seen)
            self.x_min_max.mul_(self.momentum).add_((1 - self.momentum) * seen)
        lo, hi = self.x_min_max[0].to(x.dtype), self.x_min_max[1].to(x.dtype)
        return straight_through(x, quantize_uniform(x, bits, 1, symmetric, lo=lo, hi=hi))


class Compressed:
    """Mixin for the wrappers: `compression` maps a technique name to its state."""

    BASE: ClassVar[type[nn.Module]]
    SUPPORTS: ClassVar[tuple[str, ...]]
    compression: dict[str, Technique]

    @classmethod
    def wrap(cls, layer: nn.Module):
        """The same layer, now able to take techniques: same Parameter objects, same hooks."""
        assert type(layer) is cls.BASE, f"{cls.__name__} wraps {cls.BASE.__name__}, not {type(layer).__name__}"
        new = cls.__new__(cls)
        # copy each dict (parameters, buffers, hooks) so that adding masks leaves `layer` as it was
        new.__dict__ = {k: (v.copy() if isinstance(v, dict) else v) for k, v in layer.__dict__.items()}
        new.compression = {}
        return new

    def unwrap(self) -> nn.Module:
        """The plain torch layer again, once every technique has been written into it."""
        assert all(t.phase is Phase.FIXED for t in self.compression.values())
        plain = self.BASE.__new__(self.BASE)
        plain.__dict__ = {k: v for k, v in self.__dict__.items() if k != "compression"}
        return plain

    def extra_repr(self) -> str:
        on = ", ".join(f"{name} {t.phase.value}" for name, t in self.compression.items())
        return f"{super().extra_repr()}, compression: {on or 'none'}"

    def add(self, technique: Technique) -> None:
        assert technique.name in self.SUPPORTS and technique.name not in self.compression
        self.compression[technique.name] = technique
        if isinstance(technique, Prune):
            buffer, scores = MASK_NAMES[technique.name]
            if technique.method == "l1":
                mags = magnitude(technique.name, self.weight, technique.num_heads)
                self.register_buffer(buffer, top_mask(mags, technique.dense_ratio))
            else:
                shape = score_shape(technique.name, self.weight, technique.num_heads)
                self.register_parameter(scores, init_scores(shape, self.weight))
        elif isinstance(technique, ActivationQuant) and technique.static:
            self.activation_quantizer = StaticRange(device=self.weight.device)

    def at_step(self, step: int) -> None:
        for technique in self.compression.values():
            technique.at_step(step)

    def active(self, name: str) -> Technique | None:
        technique = self.compression.get(name)
        return technique if technique is not None and technique.phase is Phase.ACTIVE else None

    def mask(self, name: str) -> torch.Tensor:
        technique = self.compression[name]
        buffer, scores = MASK_NAMES[name]
        if technique.method == "l1":
            return getattr(self, buffer)
        return learnt_mask(getattr(self, scores), technique.dense_ratio)

    def drop_mask(self, name: str) -> None:
        for attr in MASK_NAMES[name]:
            if hasattr(self, attr):
                delattr(self, attr)

    def compressed_weight(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The weight and bias the forward uses, with every active technique applied."""
        w, b = self.weight, self.bias
        quant = self.active("weight_quantization")
        if quant is not None:
            w = quant.apply(w, self.training)
        if self.active("sparse_pruning"):
            w = w * self.mask("sparse_pruning")
        for name in ("row_pruning", "channel_pruning"):  # masks (out, 1[, 1, 1]): rows and bias
            if self.active(name):
                m = self.mask(name)
                w = w * m
                b = None if b is None else b * m.reshape(-1)
        if self.active("head_pruning"):
            w = mask_heads(w, self.mask("head_pruning"))
        return w, b

    def quantize_input(self, x: torch.Tensor, groups: int) -> torch.Tensor:
        technique = self.active("activation_quantization")
        if technique is None:
            return x
        if technique.static:
            return self.activation_quantizer(x, technique.bits, technique.symmetric)
        return straight_through(x, quantize_uniform(x, technique.bits, groups, technique.symmetric))


class CompressedLinear(Compressed, nn.Linear):
    BASE = nn.Linear
    SUPPORTS = ("weight_quantization", "activation_quantization", "sparse_pruning", "row_pruning",
                "head_pruning")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.compressed_weight()
        x = self.quantize_input(x, groups=x.numel() // x.shape[-1])  # one range per token
        return F.linear(x, w, b)


class CompressedConv2d(Compressed, nn.Conv2d):
    BASE = nn.Conv2d
    SUPPORTS = ("weight_quantization", "activation_quantization", "sparse_pruning",
                "channel_pruning")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.compressed_weight()
        x = self.quantize_input(x, groups=x.shape[0] if x.dim() == 4 else 1)  # one per image
        return self._conv_forward(x, w, b)


class CompressedEmbedding(Compressed, nn.Embedding):
    BASE = nn.Embedding
    SUPPORTS = ("weight_quantization",)
    bias = None  # the shared compressed_weight() reads it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, _ = self.compressed_weight()
        return F.embedding(x, w, self.padding_idx, self.max_norm, self.norm_type,
                           self.scale_grad_by_freq, self.sparse)


WRAPPERS: dict[type[nn.Module], type[Compressed]] = {
    nn.Linear: CompressedLinear, nn.Conv2d: CompressedConv2d, nn.Embedding: CompressedEmbedding,
}
