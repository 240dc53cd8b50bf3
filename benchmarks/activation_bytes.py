"""Bytes kept for backward by a 4-layer MLP block (Linear + ReLU, fp32), with and without
`meshspeed.checkpointing.checkpoint`, and per rank with partition_activations at tp=2
(2 gloo ranks on this machine), measured by `meshspeed.testing.memtrack.saved_activation_bytes`
(every storage autograd saves, seen through torch.autograd.graph.saved_tensors_hooks;
weights left out):

    PYTHONPATH=. .venv/bin/python benchmarks/activation_bytes.py --batch 32 --width 256

Results go to docs/activation_checkpointing.md (section "Measured bytes").
"""

from __future__ import annotations

import argparse

import torch
from torch import nn


def _mlp(width: int) -> nn.Sequential:
    return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(width, width), nn.ReLU())])


def measure(batch: int, width: int, tp: int = 1) -> dict[str, int]:
    import meshspeed as deepspeed
    from meshspeed.testing.memtrack import saved_activation_bytes

    if tp > 1:
        from meshspeed import comm
        from meshspeed.topology import ParallelDims, build_topology

        topo = build_topology(ParallelDims(comm.get_world_size(), tp=tp))
        deepspeed.checkpointing.configure(topo, partition_activations=True)
    torch.manual_seed(0)
    block, x = _mlp(width), torch.randn(batch, width, requires_grad=True)
    ckpt = saved_activation_bytes(lambda t: deepspeed.checkpointing.checkpoint(block, t), x,
                                  params=block.parameters())
    return {"input": x.numel() * x.element_size(), "plain": saved_activation_bytes(block, x),
            "checkpointed": ckpt}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--width", type=int, default=256)
    args = parser.parse_args()
    from meshspeed.testing import close_pools, run_distributed

    rows = [("1 process", measure(args.batch, args.width))]
    ranks = run_distributed(measure, world_size=2, args=(args.batch, args.width, 2))
    rows += [(f"tp=2, rank {r}, partition_activations", m) for r, m in enumerate(ranks)]
    close_pools()
    print(f"4 x (Linear({args.width}, {args.width}) + ReLU), input {args.batch} x {args.width} fp32\n")
    print(f"| {'run':<36} | {'input bytes':>11} | {'kept, plain':>11} | {'kept, checkpointed':>18} |")
    print(f"|{'-' * 38}|{'-' * 13}|{'-' * 13}|{'-' * 20}|")
    for name, m in rows:
        print(f"| {name:<36} | {m['input']:>11} | {m['plain']:>11} | {m['checkpointed']:>18} |")


if __name__ == "__main__":
    main()
