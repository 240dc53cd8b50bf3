"""The `compression_training` section: DeepSpeed's compression library config, typed.

Owned by `meshspeed/compression`. Six techniques share one shape,

    "<technique>": {"shared_parameters": {"enabled": ..., "schedule_offset": ..., ...},
                    "different_groups": {"<any name>": {"params": {...},
                                                        "modules": [regex, ...],
                                                        "related_modules": [[regex, ...], ...]}}}

and `layer_reduction` is a flat block. Key names, defaults and accepted values are
DeepSpeed's (`deepspeed/compression/constants.py` before the library's removal in 0.19.x),
where DeepSpeed's code and its docs disagree, its code. What DeepSpeed accepted but then
crashed on or silently ignored is refused here with the reason (see docs/compression.md).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, model_validator

from meshspeed.config.base import NonNegInt, PositiveInt, StrictModel, whole_number

Bits = Annotated[int, BeforeValidator(whole_number), Field(ge=1, le=16)]
ActivationBits = Annotated[Literal[4, 8], BeforeValidator(whole_number)]
DenseRatio = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]
QuantType = Literal["symmetric", "asymmetric"]


class _Group(StrictModel):
    # regular expressions searched (re.search) in the names of model.named_modules()
    modules: list[str]
    # row/head/channel pruning: per entry of `modules`, the patterns of the layers that
    # consume its output (their columns / input channels / features shrink with it)
    related_modules: list[list[str]] | None = None


class _Shared(StrictModel):
    enabled: bool = False


def _check_groups(name: str, shared: _Shared, groups: dict[str, _Group], related: bool) -> None:
    if shared.enabled and not groups:
        raise ValueError(f"{name} is enabled but different_groups is empty; add a group with "
                         "params and modules, or set enabled false")
    for gname, group in groups.items():
        if group.related_modules is None:
            continue
        if not related:
            raise ValueError(f"different_groups.{gname}.related_modules: only row_pruning, "
                             "head_pruning and channel_pruning shrink related layers; remove it")
        if len(group.related_modules) != len(group.modules):
            raise ValueError(f"different_groups.{gname}: related_modules has "
                             f"{len(group.related_modules)} entries and modules {len(group.modules)}; "
                             "give one list of related patterns per pattern in modules")


# -- weight quantization -------------------------------------------------------------------
class FP16MixedQuantize(StrictModel):
    enabled: bool = False
    # the full-precision share of the weight falls by this much per step, from 1 to 0
    quantize_change_ratio: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] = 0.001


class WeightQuantShared(_Shared):
    quantizer_kernel: bool = False  # DeepSpeed's CUDA kernel choice: no effect on the numbers
    schedule_offset: NonNegInt = 0
    quantize_groups: PositiveInt = 1  # scales per weight: the flat weight cut into this many
    quantize_verbose: bool = False  # log each bit-width change
    quantization_type: QuantType = "symmetric"
    rounding: Literal["nearest", "stochastic"] = "nearest"
    # true: target_bits from schedule_offset on; false: DeepSpeed's MoQ bit schedule
    quantize_weight_in_forward: bool = False
    fp16_mixed_quantize: FP16MixedQuantize = Field(default_factory=FP16MixedQuantize)

    @model_validator(mode="after")
    def _moq_only(self):
        if self.quantize_weight_in_forward:
            if self.rounding != "nearest":
                raise ValueError('rounding "stochastic" applies only with quantize_weight_in_forward '
                                 "false (DeepSpeed rounds to nearest in the forward); set one of them")
            if self.fp16_mixed_quantize.enabled:
                raise ValueError("fp16_mixed_quantize applies only with quantize_weight_in_forward "
                                 "false (DeepSpeed ignores it in the forward); disable one of them")
        return self


class WeightQuantParams(StrictModel):
    start_bits: Bits
    target_bits: Bits
    quantization_period: PositiveInt = 1  # steps before the first one-bit drop (then doubling)

    @model_validator(mode="after")
    def _descending(self):
        if self.target_bits > self.start_bits:
            raise ValueError(f"target_bits {self.target_bits} is above start_bits "
                             f"{self.start_bits}; bits only go down: target_bits <= start_bits")
        return self


class WeightQuantGroup(_Group):
    params: WeightQuantParams


class WeightQuantization(StrictModel):
    shared_parameters: WeightQuantShared = Field(default_factory=WeightQuantShared)
    different_groups: dict[str, WeightQuantGroup] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check(self):
        _check_groups("weight_quantization", self.shared_parameters, self.different_groups, False)
        shared = self.shared_parameters
        for name, group in self.different_groups.items():
            low = group.params.target_bits <= 2
            if low and (shared.quantization_type != "symmetric" or shared.rounding != "nearest"):
                raise ValueError(f"different_groups.{name}: target_bits {group.params.target_bits} "
                                 "(ternary/binary) needs quantization_type \"symmetric\" and "
                                 "rounding \"nearest\", as in DeepSpeed")
        return self


# -- activation quantization ---------------------------------------------------------------
class ActivationQuantShared(_Shared):
    quantization_type: QuantType = "symmetric"
    # dynamic: a range per token (Linear) / per sample (Conv2d) each forward;
    # static: one range, a running min/max (momentum 0.95) updated in training
    range_calibration: Literal["dynamic", "static"] = "dynamic"
    schedule_offset: NonNegInt = 1000


class ActivationQuantParams(StrictModel):
    bits: ActivationBits


class ActivationQuantGroup(_Group):
    params: ActivationQuantParams


class ActivationQuantization(StrictModel):
    shared_parameters: ActivationQuantShared = Field(default_factory=ActivationQuantShared)
    different_groups: dict[str, ActivationQuantGroup] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check(self):
        _check_groups("activation_quantization", self.shared_parameters, self.different_groups, False)
        return self


# -- pruning ---------------------------------------------------------------------------------
class PruneParams(StrictModel):
    dense_ratio: DenseRatio  # the share of weights / rows / heads / channels kept


class PruneGroup(_Group):
    params: PruneParams


_SNIP_ONLY = ("schedule_offset_end", "schedule_offset_stride", "block_pattern", "dense_ratio",
              "excluded_modules")


class SparsePruningShared(_Shared):
    method: Literal["l1", "topk", "snip_momentum"] = "l1"
    schedule_offset: NonNegInt = 1000
    # DeepSpeed reads these only for method snip_momentum (Intel Neural Compressor's pruner)
    schedule_offset_end: NonNegInt | None = None
    schedule_offset_stride: PositiveInt | None = None
    block_pattern: str | None = None
    dense_ratio: DenseRatio | None = None
    excluded_modules: list[str] | None = None

    @model_validator(mode="after")
    def _no_snip(self):
        if self.method == "snip_momentum":
            raise ValueError('method "snip_momentum" (Intel Neural Compressor\'s gradual pruner) is '
                             'not implemented in meshspeed; use "l1" or "topk"')
        given = [k for k in _SNIP_ONLY if getattr(self, k) is not None]
        if given:
            raise ValueError(f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} read by "
                             f'DeepSpeed only for method "snip_momentum", not "{self.method}" (which '
                             "prunes from schedule_offset on); remove "
                             f"{'it' if len(given) == 1 else 'them'}")
        return self


class SparsePruning(StrictModel):
    shared_parameters: SparsePruningShared = Field(default_factory=SparsePruningShared)
    different_groups: dict[str, PruneGroup] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check(self):
        _check_groups("sparse_pruning", self.shared_parameters, self.different_groups, False)
        return self


class RowPruningShared(_Shared):
    method: Literal["l1", "topk"] = "l1"
    schedule_offset: NonNegInt = 1000


class RowPruning(StrictModel):
    shared_parameters: RowPruningShared = Field(default_factory=RowPruningShared)
    different_groups: dict[str, PruneGroup] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check(self):
        _check_groups("row_pruning", self.shared_parameters, self.different_groups, True)
        return self


class HeadPruningShared(_Shared):
    # DeepSpeed accepts "l1" here but its layer implements only "topk"; meshspeed has both
    method: Literal["l1", "topk"] = "topk"
    schedule_offset: NonNegInt = 1000
    num_heads: PositiveInt | None = None  # heads of the attention output matrix's input

    @model_validator(mode="after")
    def _heads_given(self):
        if self.enabled and self.num_heads is None:
            raise ValueError("num_heads is required when head pruning is enabled (the number of "
                             "attention heads feeding the pruned output matrix)")
        return self


class HeadPruning(StrictModel):
    shared_parameters: HeadPruningShared = Field(default_factory=HeadPruningShared)
    different_groups: dict[str, PruneGroup] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check(self):
        _check_groups("head_pruning", self.shared_parameters, self.different_groups, True)
        return self


class ChannelPruningShared(_Shared):
    method: Literal["l1", "topk"] = "l1"
    schedule_offset: NonNegInt = 1000


class ChannelPruning(StrictModel):
    shared_parameters: ChannelPruningShared = Field(default_factory=ChannelPruningShared)
    different_groups: dict[str, PruneGroup] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check(self):
        _check_groups("channel_pruning", self.shared_parameters, self.different_groups, True)
        return self


# -- layer reduction -------------------------------------------------------------------------
class LayerReduction(StrictModel):
    enabled: bool = False
    keep_number_layer: PositiveInt | None = None  # layers the student has
    module_name_prefix: str | None = None  # the layer list, e.g. "bert.encoder.layer", "layers"
    teacher_layer: list[NonNegInt] | None = None  # teacher layer copied into student layer i
    other_module_name: list[str] = Field(default_factory=list)  # copied whole: embeddings, head

    @model_validator(mode="after")
    def _complete(self):
        if not self.enabled:
            return self
        missing = [k for k in ("keep_number_layer", "module_name_prefix", "teacher_layer")
                   if getattr(self, k) is None]
        if missing:
            raise ValueError(f"layer_reduction is enabled but {', '.join(missing)} "
                             f"{'is' if len(missing) == 1 else 'are'} missing")
        if len(self.teacher_layer) != self.keep_number_layer:
            raise ValueError(f"teacher_layer names {len(self.teacher_layer)} layers and "
                             f"keep_number_layer is {self.keep_number_layer}; name one teacher "
                             "layer per student layer")
        return self


TECHNIQUES = ("weight_quantization", "activation_quantization", "sparse_pruning", "row_pruning",
              "head_pruning", "channel_pruning")


class CompressionConfig(StrictModel):
    layer_reduction: LayerReduction = Field(default_factory=LayerReduction)
    weight_quantization: WeightQuantization = Field(default_factory=WeightQuantization)
    activation_quantization: ActivationQuantization = Field(default_factory=ActivationQuantization)
    sparse_pruning: SparsePruning = Field(default_factory=SparsePruning)
    row_pruning: RowPruning = Field(default_factory=RowPruning)
    head_pruning: HeadPruning = Field(default_factory=HeadPruning)
    channel_pruning: ChannelPruning = Field(default_factory=ChannelPruning)

    def enabled_techniques(self) -> list[str]:
        """The module techniques switched on, in DeepSpeed's order (layer_reduction aside)."""
        return [t for t in TECHNIQUES if getattr(self, t).shared_parameters.enabled]

    @property
    def enabled(self) -> bool:
        """Whether anything is asked for: a module technique or layer reduction."""
        return bool(self.enabled_techniques()) or self.layer_reduction.enabled
