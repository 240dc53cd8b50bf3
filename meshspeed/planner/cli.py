"""`meshspeed estimate`: memory per device for each ZeRO stage.

    meshspeed estimate --params 7.5e9 --dp 64           # breakdown for stages 0-3
    meshspeed estimate --params 7.5B                    # the paper's Table 1 over N_d
    meshspeed estimate --layers 32 --d-model 4096 --heads 32 --vocab 32000 \\
        --seq-len 4096 --micro-batch 1 --dp 8 --stage 3 # parameters counted from the shape
    meshspeed estimate --params 2e9 --dp 1 --offload-optimizer nvme --offload-param nvme
                                                        # ZeRO-Infinity: buffers, and whether
                                                        # they fit this machine's memory
"""

from __future__ import annotations

import argparse
import json
import sys

from meshspeed.planner.activations import ModelShape, param_count
from meshspeed.planner.estimate import (
    estimate_memory,
    estimate_table,
    format_report,
    format_table,
    valid_stages,
)
from meshspeed.planner.fit import fit, format_fit
from meshspeed.planner.hardware import available_memory, parse_bytes
from meshspeed.planner.nvme_defaults import ARGS, KNOB_DEFAULTS, choose, format_choice
from meshspeed.planner.offload import UnitSizes, assumed_shape

_SUFFIX = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}
_SHAPE_ARGS = ("layers", "d_model", "heads", "vocab")


def _count(text: str) -> float:
    """A number such as 7.5e9, 7.5B, 350M or 1T."""
    unit = text[-1:].upper()
    try:
        return float(text[:-1]) * _SUFFIX[unit] if unit in _SUFFIX else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a count: {text!r} (try 7.5e9 or 7.5B)") from None


def _bytes(text: str) -> float:
    value = float(text)
    return int(value) if value.is_integer() else value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--params", type=_count,
                        help="parameter count (7.5e9, 7.5B); default: counted from the shape")
    parser.add_argument("--dp", type=int,
                        help="data-parallel degree N_d; omit for the paper's Table 1 layout")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default 1)")
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="with --tp: norms and dropout on a sequence shard too")
    parser.add_argument("--stage", type=int, choices=(0, 1, 2, 3),
                        help="one ZeRO stage (default: every stage the offload settings allow)")
    parser.add_argument("--param-bytes", type=_bytes, default=2, help="default 2 (bf16/fp16)")
    parser.add_argument("--grad-bytes", type=_bytes, default=2, help="default 2")
    parser.add_argument("--optimizer-bytes", type=_bytes, default=12,
                        help="K, default 12 (fp32 master weights + Adam moments)")
    parser.add_argument("--comm-bytes", type=_bytes, help="gradient bucket dtype bytes")
    parser.add_argument("--offload-optimizer", choices=("cpu", "nvme"))
    parser.add_argument("--offload-param", choices=("cpu", "nvme"), help="stage 3 only")
    parser.add_argument("--reduce-bucket-size", type=_count, default=5e8)
    # the buffer settings below default to DeepSpeed's (5e7, 1e9, 1e9, 4, 5, 1e8), except
    # with both offloads on nvme and --dp: then those not given are chosen as initialize
    # chooses them (meshspeed/planner/nvme_defaults.py, Note [defaults that fit])
    parser.add_argument("--prefetch-bucket-size", type=_count)
    parser.add_argument("--max-live-parameters", type=_count)
    parser.add_argument("--sub-group-size", type=_count,
                        help="zero_optimization.sub_group_size (ZeRO-Infinity buffers)")
    parser.add_argument("--optimizer-buffer-count", type=int, help="offload_optimizer.buffer_count")
    parser.add_argument("--param-buffer-count", type=int, help="offload_param.buffer_count")
    parser.add_argument("--param-buffer-size", type=_count, help="offload_param.buffer_size")
    parser.add_argument("--no-overlap-comm", action="store_true",
                        help="one gradient bucket instead of two")
    memory = parser.add_argument_group("host memory (with offload: does a rank fit?)")
    memory.add_argument("--host-memory", type=lambda v: parse_bytes(v, "--host-memory"),
                        help="bytes the ranks on one host may use (24GiB, 2.4e10); "
                             "default: MemAvailable of this machine")
    memory.add_argument("--ranks-per-host", type=int, default=1,
                        help="processes sharing that memory (default 1)")
    memory.add_argument("--device", choices=("cpu", "gpu"),
                        help="where training runs; on \"cpu\" the device buffers and activations "
                             "are RAM too (default: gpu if torch sees one, else cpu)")
    shape = parser.add_argument_group("activations (a Llama-like decoder)")
    shape.add_argument("--layers", type=int)
    shape.add_argument("--d-model", type=int)
    shape.add_argument("--heads", type=int)
    shape.add_argument("--kv-heads", type=int, help="default: --heads")
    shape.add_argument("--ffn-hidden", type=int, help="default: Llama's 8/3 d_model rule")
    shape.add_argument("--vocab", type=int)
    shape.add_argument("--seq-len", type=int)
    shape.add_argument("--micro-batch", type=int, default=1)
    shape.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def _shape(args: argparse.Namespace) -> ModelShape | None:
    given = [getattr(args, name) is not None for name in _SHAPE_ARGS]
    if not any(given):
        return None
    if not all(given) or args.seq_len is None:
        raise ValueError("activations need --layers, --d-model, --heads, --vocab and --seq-len")
    return ModelShape(args.layers, args.d_model, args.heads, args.vocab,
                      ffn_hidden=args.ffn_hidden, n_kv_head=args.kv_heads)


def main(args: argparse.Namespace) -> int:
    try:
        shape = _shape(args)
        num_params = args.params if args.params is not None else (
            param_count(shape) if shape is not None else None)
        if num_params is None:
            raise ValueError("give --params, or a model shape to count them from")
        stages = (args.stage,) if args.stage is not None else valid_stages(
            args.offload_optimizer, args.offload_param)
        kwargs = {
            "param_bytes": args.param_bytes,
            "grad_bytes": args.grad_bytes,
            "optimizer_bytes": args.optimizer_bytes,
            "comm_dtype_bytes": args.comm_bytes,
            "offload_optimizer": args.offload_optimizer,
            "offload_param": args.offload_param,
            "model_shape": shape,
            "micro_batch_size": args.micro_batch,
            "seq_len": args.seq_len,
            "activation_checkpointing": args.activation_checkpointing,
            "overlap_comm": not args.no_overlap_comm,
            "reduce_bucket_size": int(args.reduce_bucket_size),
            "tp": args.tp,
            "sequence_parallel": args.sequence_parallel,
        }
        chosen = _chosen_knobs(args, shape, num_params)
        kwargs.update({arg: int(v) if v is not None else chosen.get(arg, default)
                       for arg, default in KNOB_DEFAULTS.items() for v in [getattr(args, arg)]})
        if args.dp is None:
            rows = estimate_table(num_params, stages=stages, **kwargs)
            text = format_table(rows)
            if shape is not None:
                text += "\n\n" + format_table(rows, key="tiers.device")
            payload = rows
        else:
            payload = [estimate_memory(num_params, args.dp, s, **kwargs) for s in stages]
            text = format_report(payload)
            if "line" in chosen:
                text += "\n" + chosen["line"]
            for est in payload:
                line = _host_memory(est, kwargs, args)
                if line:
                    text += "\n" + line
    except ValueError as err:
        print(f"meshspeed estimate: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(payload, indent=2) if args.json else text)
    return 0


def _chosen_knobs(args: argparse.Namespace, shape, num_params: float) -> dict:
    """ZeRO-Infinity's buffer settings not given on the command line, chosen as initialize
    chooses them (Note [defaults that fit]), by estimate keyword, with the one line it logs
    under "line"; empty unless both offloads are on nvme at one --dp and tp 1."""
    if not (args.offload_optimizer == args.offload_param == "nvme" and args.dp is not None
            and args.tp == 1 and args.stage in (None, 3)):
        return {}
    given = {key: int(getattr(args, arg)) for key, arg in ARGS.items()
             if getattr(args, arg) is not None}
    if len(given) == len(ARGS):
        return {}
    available = _available(args)[0]
    per_rank = None if available is None else int(available // max(1, args.ranks_per_host))
    sizes = UnitSizes.of(shape if shape is not None else assumed_shape(num_params))
    choice = choose(sizes, args.dp, per_rank, given, on_cpu=(args.device or _detect_device()) == "cpu",
                    param_bytes=args.param_bytes, comm_bytes=args.comm_bytes or 4,
                    num_params=round(num_params))
    line = format_choice(choice) if choice.fits else f"ZeRO-Infinity: nothing fits: {choice.problem}"
    return {ARGS[k]: choice.values[k] for k in choice.chosen} | {"line": line}


def _available(args: argparse.Namespace) -> tuple[float | None, str]:
    if args.host_memory is not None:
        return args.host_memory, "--host-memory"
    return available_memory(), "MemAvailable"


def _host_memory(est: dict, kwargs: dict, args: argparse.Namespace) -> str | None:
    """The host-memory verdict for an estimate that offloads (Note [the knob that fits] in
    meshspeed/planner/fit.py), stored in the estimate as "host_memory"; None otherwise."""
    if est["offload_optimizer"] is None and est["offload_param"] is None:
        return None
    if args.ranks_per_host < 1:
        raise ValueError(f"--ranks-per-host must be >= 1, got {args.ranks_per_host}")
    available, source = _available(args)
    if available is None:
        return "host memory: not checked (no MemAvailable in /proc/meminfo; pass --host-memory)"
    on_cpu = (args.device or _detect_device()) == "cpu"
    verdict = fit(est["num_params"], est["dp"], est["stage"], available, on_cpu=on_cpu,
                  ranks=args.ranks_per_host, **kwargs)
    est["host_memory"] = {"need": verdict.need, "available": verdict.available,
                          "source": source, "on_cpu": on_cpu, "fits": verdict.fits,
                          "changes": verdict.changes, "need_after": verdict.need_after}
    return format_fit(verdict, source)


def _detect_device() -> str:
    # lazy: torch is needed only to look for an accelerator, and only for this check
    import torch

    return "gpu" if torch.cuda.is_available() else "cpu"
