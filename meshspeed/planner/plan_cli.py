"""`meshspeed plan`: the fastest layouts for a model on a cluster, explained.

    meshspeed plan --model config.json --gpus 64 --gpu-memory 80GB \\
        --link intra=900GB/s,inter=50GB/s --global-batch 512 --seq-len 4096 \\
        --write-config ds.json --plot plan.png
"""

from __future__ import annotations

import argparse
import json
import sys

from meshspeed.planner.plan import plan


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="a meshspeed GPTConfig JSON or a Hugging Face config.json")
    parser.add_argument("--gpus", type=int, required=True)
    parser.add_argument("--gpu-memory", required=True, help="per device, e.g. 80GB")
    parser.add_argument("--link", default="intra=900GB/s,inter=50GB/s",
                        help="bandwidth per rank of each link (pcie=... too)")
    parser.add_argument("--global-batch", type=int, required=True, help="samples per step")
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--peak-tflops", type=float, default=400.0, help="per device")
    parser.add_argument("--mfu", type=float, default=0.5, help="fraction of peak compute reaches")
    parser.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default="bf16")
    parser.add_argument("--headroom", type=float, default=0.1,
                        help="fraction of device memory kept for fragmentation")
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--write-config", metavar="OUT.json")
    parser.add_argument("--plot", metavar="OUT.png")
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def main(args: argparse.Namespace) -> int:
    try:
        result = plan(args.model, args.gpus, args.gpu_memory, args.link,
                      global_batch=args.global_batch, seq_len=args.seq_len,
                      gpus_per_node=args.gpus_per_node, peak_flops=args.peak_tflops * 1e12,
                      mfu=args.mfu, precision=args.precision, headroom=args.headroom)
        best = result.best
        if args.write_config:
            result.write_config(args.write_config)
        if args.plot:
            result.plot(args.plot, args.top)
    except (ValueError, RuntimeError) as err:
        print(f"meshspeed plan: error: {err}", file=sys.stderr)
        return 2
    if args.json:
        rows = [{"layout": ch.candidate.label(), "config": ch.to_config(), "memory": ch.memory,
                 "time": ch.time} for ch in result.candidates[:args.top]]
        print(json.dumps({"best": rows[0], "candidates": rows, "explain": best.explain()}, indent=2))
    else:
        print(result.table(args.top))
        print(f"\nbest: {best.candidate.label()}\n{best.explain()}")
        if args.write_config:
            print(f"\nwrote {args.write_config}")
    return 0
