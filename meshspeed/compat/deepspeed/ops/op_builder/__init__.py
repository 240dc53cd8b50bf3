"""`deepspeed.ops.op_builder`: DeepSpeed's op builders, answering for meshspeed.

DeepSpeed compiles its ops (CUDA or C++ extensions) through one builder class per op, and
scripts and test suites ask a builder whether the op can run here before using it:
`FusedAdamBuilder().is_compatible()`, `deepspeed.ops.__compatible_ops__["fused_adam"]`.

Note [builders tell the truth]
meshspeed compiles nothing, so the question a builder answers is whether meshspeed has the
op, under any implementation: `is_compatible()` is True where it does (IMPLEMENTED names
where: FusedAdam is torch's fused/foreach Adam, the NVMe offload is meshspeed's own aio),
and False where not, with the reason in `incompatible_reason` and in the warning
`is_compatible(verbose=True)` logs. `load()` never compiles: it raises an
OpNotProvidedError (a RuntimeError, what DeepSpeed's failed builds raise) naming where
meshspeed's implementation lives, because no builder of meshspeed returns a compiled
module with DeepSpeed's kernel-level functions.
"""

from __future__ import annotations

import logging

log = logging.getLogger("meshspeed")

# op name -> where meshspeed implements it (is_compatible() is True)
IMPLEMENTED = {
    "fused_adam": "meshspeed.optim.FusedAdam (torch's fused / foreach Adam)",
    "cpu_adam": "meshspeed.optim.DeepSpeedCPUAdam (torch's Adam on host tensors)",
    "async_io": "meshspeed.offload.aio (NVMe offload with threads and O_DIRECT files)",
    "transformer_inference": "meshspeed.inference.kernels (the inference engine's fused kernels)",
}
# op name -> why meshspeed does not have it (is_compatible() is False)
NOT_PROVIDED = {
    "cpu_adagrad": "meshspeed has no Adagrad optimizer",
    "cpu_lion": "meshspeed has no Lion optimizer",
    "fused_lion": "meshspeed has no Lion optimizer",
    "fused_lamb": "meshspeed has no Lamb optimizer (OneBitLamb is the only Lamb)",
    "quantizer": "meshspeed's quantizers are Python functions (compression/, zero/qgz.py); "
                 "there is no quantizer kernel module",
    "fp_quantizer": "meshspeed has no FP6/FP8 quantizer kernels",
    "transformer": "meshspeed has no fused training transformer layer",
    "stochastic_transformer": "meshspeed has no fused training transformer layer",
    "sparse_attn": "meshspeed has no block-sparse attention kernels",
    "evoformer_attn": "meshspeed has no Evoformer attention kernels",
    "random_ltd": "meshspeed has no random-LTD kernels",
    "spatial_inference": "meshspeed has no diffusion inference kernels",
    "inference_core_ops": "meshspeed's inference engine has no DeepSpeed-FastGen kernels",
    "cutlass_ops": "meshspeed's inference engine has no DeepSpeed-FastGen kernels",
    "ragged_device_ops": "meshspeed's inference engine has no DeepSpeed-FastGen kernels",
    "ragged_ops": "meshspeed's inference engine has no DeepSpeed-FastGen kernels",
    "gds": "meshspeed's NVMe offload does not use GPUDirect Storage",
    "utils": "meshspeed has no flatten/unflatten kernel module (torch's are used)",
    "pin_memory": "meshspeed pins host memory with torch (tensor.pin_memory())",
    "dc": "meshspeed has no DeepCompile",
    "deepspeed_not_implemented": "not an op",
}


class OpNotProvidedError(RuntimeError):
    """A builder was asked to build or load an op; meshspeed compiles none."""


class OpBuilder:
    """One op: `NAME`, `is_compatible()`, `load()` (Note [builders tell the truth])."""

    NAME = "deepspeed_not_implemented"

    def __init__(self, name: str | None = None):
        self.name = name or self.NAME

    def absolute_name(self) -> str:
        return f"deepspeed.ops.{self.name}_op"

    @property
    def incompatible_reason(self) -> str | None:
        if self.name in IMPLEMENTED:
            return None
        return NOT_PROVIDED.get(self.name, f"meshspeed has no op named {self.name!r}")

    def is_compatible(self, verbose: bool = False) -> bool:
        reason = self.incompatible_reason
        if reason is not None and verbose:
            log.warning("%s is not compatible: %s", self.name, reason)
        return reason is None

    def load(self, verbose: bool = True):
        where = IMPLEMENTED.get(self.name)
        if where is not None:
            raise OpNotProvidedError(f"{self.name}: meshspeed compiles no ops and has no module to load; "
                                     f"use {where}")
        raise OpNotProvidedError(f"{self.name}: {self.incompatible_reason}")

    def jit_load(self, verbose: bool = True):
        return self.load(verbose)


def _builder(class_name: str, op: str) -> type[OpBuilder]:
    return type(class_name, (OpBuilder,), {"NAME": op, "__doc__": f"DeepSpeed's builder of `{op}`."})


_CLASSES = {
    "AsyncIOBuilder": "async_io", "CPUAdagradBuilder": "cpu_adagrad", "CPUAdamBuilder": "cpu_adam",
    "CPULionBuilder": "cpu_lion", "EvoformerAttnBuilder": "evoformer_attn", "FPQuantizerBuilder": "fp_quantizer",
    "FusedAdamBuilder": "fused_adam", "FusedLambBuilder": "fused_lamb", "FusedLionBuilder": "fused_lion",
    "GDSBuilder": "gds", "InferenceBuilder": "transformer_inference", "InferenceCoreBuilder": "inference_core_ops",
    "InferenceCutlassBuilder": "cutlass_ops", "NotImplementedBuilder": "deepspeed_not_implemented",
    "PinMemoryBuilder": "pin_memory", "QuantizerBuilder": "quantizer", "RaggedOpsBuilder": "ragged_device_ops",
    "RaggedUtilsBuilder": "ragged_ops", "RandomLTDBuilder": "random_ltd", "SparseAttnBuilder": "sparse_attn",
    "SpatialInferenceBuilder": "spatial_inference", "StochasticTransformerBuilder": "stochastic_transformer",
    "TransformerBuilder": "transformer", "UtilsBuilder": "utils", "DeepCompileBuilder": "dc",
}
globals().update({name: _builder(name, op) for name, op in _CLASSES.items()})

ALL_OPS = {op: globals()[name]() for name, op in _CLASSES.items()}


def compatible_ops() -> dict[str, bool]:
    """`deepspeed.ops.__compatible_ops__`: op name -> is_compatible()."""
    return {op: builder.is_compatible() for op, builder in ALL_OPS.items()}


__all__ = ["ALL_OPS", "IMPLEMENTED", "NOT_PROVIDED", "OpBuilder", "OpNotProvidedError", "compatible_ops",
           *_CLASSES]
