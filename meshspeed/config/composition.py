"""What composes with what: one table, feature x feature -> composes, or the error sentence.

Note [one composition table]
Every rule of the form "A with B is not supported" lives here and nowhere else. A feature
is a thing a run can have (an axis of the mesh, a ZeRO stage, an offload tier, an
optimizer that communicates by itself, ...); `FEATURES` names them and says how a user
recognises each in an error. `RULES` lists the pairs that do not compose, with the
sentence the user gets; every pair not listed composes. `check(active)` raises one
ConfigError with the sentence of every refused pair among the run's features (the
descriptions carry the run's own degrees, e.g. "context parallelism (size 4)").

Two callers: the config's own validation, for the features a config alone decides
(`config_features`), so `load_config` refuses them before anything is built; and
`meshspeed.initialize` (engine/build.py), with the features the mesh and the model add
(pipeline stages, MoE layers, a model built under zero.Init, an mpu). Adding a feature
means a FEATURES entry, its rows in RULES, and, if the model or mesh decides it,
a line in engine/build.py's `run_features` (docs/architecture.md, "Adding an axis").
tests/config/test_composition.py walks every pair of the table.
"""

from __future__ import annotations

from collections.abc import Mapping

from meshspeed.config.errors import ConfigError

__all__ = ["FEATURES", "RULES", "check", "config_features", "refusals"]

# feature -> how the error names it when the run has no more specific description
FEATURES: dict[str, str] = {
    "tp": "tensor parallelism",
    "sp": "tensor_parallel.sequence_parallel",
    "pp": "a pipeline of several stages",
    "cp": "context parallelism",
    "ep": "expert parallelism (MoE ep_size > 1)",
    "moe": "MoE layers",
    "zero": "ZeRO stages 1-3",
    "offload": "ZeRO offload (offload_optimizer / offload_param)",
    "nvme_optimizer": 'offload_optimizer.device "nvme"',
    "zero_init": "a model built under meshspeed.zero.Init",
    "mpu": "initialize(mpu=...)",
    "onebit": "a 1-bit optimizer (OneBitAdam, ZeroOneAdam, OneBitLamb)",
    "half": "fp16 / bf16 training",
    "fp16": "fp16 training",
    "comm_dtype": "communication_data_type",
    "grad_compression": "gradient_compression",
    "tied_stages": "tied layers across pipeline stages",
    "compression": "compression_training",
}

_ONLY_DP = "runs with data parallelism only in this version"

# (a, b) -> the sentence; {a} and {b} are the run's descriptions of the two features
RULES: dict[tuple[str, str], str] = {
    ("cp", "pp"): "{a} with {b} is not supported in this version; use one of them (context "
                  "parallelism composes with data, tensor parallelism and every ZeRO stage)",
    ("cp", "mpu"): "{a} with {b}: the sequence groups come from the mesh; drop mpu= and give "
                   "tensor_parallel.autotp_size",
    ("cp", "sp"): "{b} with {a}: both split the sequence; keep context_parallel (it also splits "
                  "the attention) and turn tensor_parallel.sequence_parallel off",
    ("mpu", "pp"): "{a} with {b}: the pipeline layout comes from the module and the config here; "
                   "drop mpu= (tensor parallelism: tensor_parallel.autotp_size)",
    ("ep", "cp"): "{a} with {b} is not supported in this version; expert parallelism composes "
                  "with data, tensor parallelism and every ZeRO stage",
    ("ep", "pp"): "{a} with {b} is not supported in this version; expert parallelism composes "
                  "with data, tensor parallelism and every ZeRO stage",
    ("ep", "mpu"): "{a} with {b} is not supported in this version; expert parallelism composes "
                   "with data, tensor parallelism and every ZeRO stage",
    ("ep", "offload"): "{a} with {b} is not supported in this version; turn offload off or build "
                       "the MoE layers with ep_size=1",
    ("ep", "zero_init"): "{a} with {b} is not supported in this version (zero.Init slices expert "
                         "weights over all data-parallel ranks); build the model normally, ZeRO-3 "
                         "still shards it",
    ("sp", "moe"): "{a} with {b} is not supported in this version: every tensor-parallel rank must "
                   "route the whole sequence; turn tensor_parallel.sequence_parallel off",
    ("tp", "zero_init"): "{a} with {b}: models built under meshspeed.zero.Init cannot be split for "
                         "tensor parallelism in this version; build the model normally (ZeRO-3 "
                         "still shards it over the data-parallel axis)",
    ("sp", "nvme_optimizer"): "{a} with {b}: the partial gradients of sequence-parallel norms are "
                              "summed over tp in memory, and NVMe offload keeps gradients in files; "
                              'use offload_optimizer.device "cpu" or turn sequence_parallel off',
    ("tied_stages", "nvme_optimizer"): "{a} with {b}: their gradients are summed over the stages "
                                       'in memory; use "cpu"',
    ("onebit", "zero"): "{a} needs ZeRO stage 0 (got {b}): its compressed all-reduce replaces the "
                        "gradient all-reduce, which ZeRO shards; DeepSpeed refuses this too",
    ("onebit", "half"): "{a} runs in fp32 only in this version (got {b}); turn fp16 / bf16 off",
    ("onebit", "tp"): "{a} " + _ONLY_DP + " (got {b})",
    ("onebit", "pp"): "{a} " + _ONLY_DP + " (got {b})",
    ("onebit", "cp"): "{a} " + _ONLY_DP + " (got {b})",
    ("onebit", "ep"): "{a} " + _ONLY_DP + " (got {b})",
    ("onebit", "comm_dtype"): "{a} compresses to 1 bit itself; drop {b}",
    ("onebit", "grad_compression"): "{b} with {a}: the optimizer compresses its momentum to 1 bit "
                                    "itself; drop gradient_compression",
    ("grad_compression", "zero"): "{a}: runs with data parallelism (zero_optimization.stage 0) only "
                                  "in this version; {b} reduce-scatters uncompressed gradients, so "
                                  "drop gradient_compression or use stage 0",
    ("grad_compression", "fp16"): "{a} with {b}: the loss scale changes the gradients' scale between "
                                  "steps, which the error-feedback residual would carry over; use "
                                  "bf16 or fp32",
    ("grad_compression", "comm_dtype"): "{a} and {b} both choose how gradients travel; give one",
    ("compression", "tp"): "{a} with {b} is not supported: the compressed layers' masks and scales "
                           "are not split by tensor parallelism; train compression without tensor "
                           "parallelism",
}


def _key(a: str, b: str) -> tuple[str, str] | None:
    if (a, b) in RULES:
        return a, b
    if (b, a) in RULES:
        return b, a
    return None


def refusals(active: Mapping[str, str]) -> list[str]:
    """The sentences of every refused pair among `active` (feature -> its description in
    this run), in table order."""
    unknown = sorted(set(active) - set(FEATURES))
    if unknown:
        raise ValueError(f"unknown composition features {unknown}; known: {sorted(FEATURES)}")
    out = []
    for (a, b), sentence in RULES.items():
        if a in active and b in active:
            out.append(sentence.format(a=active[a], b=active[b]))
    return out


def check(active: Mapping[str, str]) -> None:
    """Raise one ConfigError naming every pair of `active` features that does not compose."""
    problems = refusals(active)
    if problems:
        raise ConfigError(problems)


def config_features(cfg) -> dict[str, str]:
    """The features a config alone decides (a MeshspeedConfig, or its validator's `self`)."""
    z = cfg.zero_optimization
    out: dict[str, str] = {}
    tp = cfg.tensor_parallel
    if tp.size > 1:
        out["tp"] = f"tensor parallelism (tensor_parallel.autotp_size {tp.size})"
    if tp.sequence_parallel:
        out["sp"] = FEATURES["sp"]
    if z.stage > 0:
        out["zero"] = f"ZeRO stage {z.stage}"
    oo, op = z.offload_optimizer, z.offload_param
    if (oo is not None and oo.device != "none") or (op is not None and op.device != "none"):
        out["offload"] = FEATURES["offload"]
    if oo is not None and oo.device == "nvme":
        out["nvme_optimizer"] = FEATURES["nvme_optimizer"]
    if cfg.fp16.enabled or cfg.bf16.enabled:
        out["half"] = "fp16" if cfg.fp16.enabled else "bf16"
    if cfg.fp16.enabled:
        out["fp16"] = FEATURES["fp16"]
    if cfg.communication_data_type is not None:
        out["comm_dtype"] = f"communication_data_type {cfg.communication_data_type}"
    if cfg.gradient_compression is not None:
        out["grad_compression"] = FEATURES["grad_compression"]
    if cfg.optimizer is not None and cfg.optimizer.type in ("OneBitAdam", "ZeroOneAdam", "OneBitLamb"):
        out["onebit"] = f"optimizer.type: {cfg.optimizer.type}"
    if cfg.compression_training.enabled_techniques():
        out["compression"] = FEATURES["compression"]
    cp = cfg.sequence.size
    if cp > 1:
        out["cp"] = f"context parallelism (size {cp})"
    return out
