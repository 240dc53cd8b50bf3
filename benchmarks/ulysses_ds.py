"""DeepSpeed-Ulysses: meshspeed's DistributedAttention beside DeepSpeed 0.19.8's, on the same
shapes, in one run, forward + backward time per call.

    .venv/bin/python benchmarks/ulysses_ds.py                     # about 10 minutes on 2 cores
    .venv/bin/python benchmarks/ulysses_ds.py --degrees 2 --seq 2048 --repeats 3   # a quick look
        [--json benchmarks/results/ulysses.json]

For each degree P in `--degrees`, P gloo ranks on this machine (one intra-op thread each)
build both frameworks' `DistributedAttention(local_attention, WORLD, scatter_idx=2,
gather_idx=...)` and call them as a DeepSpeed script does, `attn(q, k, v, batch_dim_idx)`,
on the same tensors (fixed seeds): b x S tokens x h heads x d = 64 in fp32, this rank's
S/P tokens, in DeepSpeed's [s, b, h, d] layout and (exchange mode) batch-first [b, s, h, d].

Note [both frameworks in the same ranks]
This machine is shared and its load moves by a factor of two within a minute, so runs of
one framework after the other compare two different machines. The ranks therefore hold
both frameworks and alternate them call by call (the order rotating each repeat), which
puts the same load on both. They run in the anchor venv (Note [DeepSpeed in its own
venv] in zero.py: torch 2.13 CPU, DeepSpeed 0.19.8, DS_ACCELERATOR=cpu), with this
checkout first on PYTHONPATH for meshspeed, whose sequence package needs only torch;
the torch is the one this venv has too. Without that venv only meshspeed runs.

Note [what is timed]
One call is the forward and the backward with a fixed random upstream gradient, started at
a barrier; its time is the slowest rank's. The table shows the median of `--repeats` calls
(twice as many in exchange mode) after `--warmup` untimed ones, and as the ratio the
median over repeats of meshspeed's call over DeepSpeed's call of the same repeat: the two
ran back to back, under nearly the same load, so the paired ratio is steadier than the
ratio of the medians when other work comes and goes. Two modes:
- attention: the local attention is causal SDPA in the layout (the same function for
  both frameworks: permute to [b, h, S, d], `scaled_dot_product_attention`, permute back).
  This is the workload; with S in the thousands the attention's S^2 work dominates, so the
  ratio says whether the layer adds anything to it. "meshspeed (default)" is meshspeed's
  own local_attention=None (the same SDPA, its q, k, v in one all-to-all).
- exchange: the local attention is q + k + v, which costs almost nothing, so the time is
  the layer itself: the all-to-alls and the copies around them.
"others' load" is the share of the machine's CPU time that other processes took meanwhile
(pipeline_worker.py's LoadMeter): where it is high, the times are the scheduler's as much
as the frameworks'. At P = 4 the 2 cores are oversubscribed (pipeline.py's Note [p = 4 on two cores]): both
frameworks run under the same time sharing, so the ratio still compares them; the absolute
times do not measure a 4-way split.

Before timing, one small case per layout (S = 256, b = 2, h = 8) runs through every
variant, and the report gives the largest difference from DeepSpeed's output and q, k, v
gradients on any rank: the frameworks compute the same thing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # siblings, also in spawned ranks

from anchor_ranks import ANCHOR_PY, enter_rank, run_degree, spawn_ranks  # imports no meshspeed
from pipeline_worker import LoadMeter  # imports only torch

LAYOUTS = {"sbhd": (2, 0, 1), "bshd": (2, 1, 0)}  # (scatter_idx, gather_idx, batch_dim_idx)
HEAD_DIM = 64
PARITY = [("sbhd", 2, 8, 256), ("bshd", 2, 8, 256)]  # (layout, b, h, S)
DEEPSPEED, MESHSPEED, DEFAULT = "DeepSpeed", "meshspeed", "meshspeed (default)"


# -- what the ranks run ------------------------------------------------------------------------------


def _sdpa_local(layout: str):
    """Causal SDPA in `layout`: the local attention both frameworks get."""
    order = tuple(layout.index(c) for c in "bhsd")
    back = tuple(sorted(range(4), key=order.__getitem__))

    def attend(q, k, v):
        out = F.scaled_dot_product_attention(q.permute(order), k.permute(order), v.permute(order), is_causal=True)
        return out.permute(back)

    return attend


def _exchange_local(q, k, v):
    return q + k + v


def _inputs(layout: str, b: int, h: int, S: int, rank: int, world: int):
    """This rank's q, k, v (leaves) and upstream gradient, in the layout (seeded)."""
    g = torch.Generator().manual_seed(S * 31 + h * 7 + b)
    full = [torch.randn(b, S, h, HEAD_DIM, generator=g) for _ in range(4)]
    s = S // world
    local = [t[:, rank * s:(rank + 1) * s].permute(["bshd".index(c) for c in layout]).contiguous() for t in full]
    return [t.requires_grad_() for t in local[:3]], local[3]


def _variants(classes: dict, mode: str, layout: str) -> dict:
    """name -> DistributedAttention module: each framework with the shared local attention,
    and in attention mode meshspeed's own default."""
    import torch.distributed as dist

    scatter, gather, _ = LAYOUTS[layout]
    local = _sdpa_local(layout) if mode == "attention" else _exchange_local
    out = {name: cls(local, dist.group.WORLD, scatter, gather) for name, cls in classes.items()}
    if mode == "attention":
        out[DEFAULT] = classes[MESHSPEED](None, dist.group.WORLD, scatter, gather, causal=True)
    return out


def _call(attn, qkv, grad, batch_dim: int) -> float:
    import torch.distributed as dist

    for t in qkv:
        t.grad = None
    dist.barrier()
    t0 = time.perf_counter()
    attn(*qkv, batch_dim).backward(grad)
    seconds = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return float(seconds)


def _parity(classes: dict, rank: int, world: int) -> float:
    """Largest difference from DeepSpeed's output and gradients, on this rank."""
    worst = 0.0
    for layout, b, h, S in PARITY:
        qkv, grad = _inputs(layout, b, h, S, rank, world)
        results = {}
        for name, attn in _variants(classes, "attention", layout).items():
            for t in qkv:
                t.grad = None
            out = attn(*qkv, LAYOUTS[layout][2])
            out.backward(grad)
            results[name] = [out.detach().clone()] + [t.grad.clone() for t in qkv]
        for name, tensors in results.items():
            for a, b_ in zip(tensors, results.get(DEEPSPEED, tensors), strict=True):
                worst = max(worst, float((a - b_).abs().max()))
    return worst


def _rank(rank: int, world: int, port: int, plan: dict, out: str) -> None:
    enter_rank(rank, world, port)
    import torch.distributed as dist

    from meshspeed.sequence.layer import DistributedAttention as Meshspeed

    classes = {MESHSPEED: Meshspeed}
    if plan["deepspeed"]:
        import deepspeed
        from deepspeed.sequence.layer import DistributedAttention as Deepspeed

        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
        classes = {DEEPSPEED: Deepspeed, **classes}
    else:
        dist.init_process_group("gloo")
    worst = torch.tensor([_parity(classes, rank, world)])
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    rows = []
    for case in plan["cases"]:
        qkv, grad = _inputs(case["layout"], case["b"], case["h"], case["S"], rank, world)
        variants = list(_variants(classes, case["mode"], case["layout"]).items())
        batch_dim = LAYOUTS[case["layout"]][2]
        seconds = {name: [] for name, _ in variants}
        meter = LoadMeter()
        for i in range(plan["warmup"] + case["repeats"]):
            if i == plan["warmup"]:
                meter.start()
            for name, attn in variants[i % len(variants):] + variants[:i % len(variants)]:
                t = _call(attn, qkv, grad, batch_dim)
                if i >= plan["warmup"]:
                    seconds[name].append(t)
        others = meter.stop(dist.all_gather_object)
        rows += [{**case, "P": world, "variant": name, "seconds": sec, "others": others} for name, sec in seconds.items()]
        if rank == 0:
            print(table(rows[-len(seconds):]).splitlines()[-1], flush=True)
    if rank == 0:
        Path(out).write_text(json.dumps({"rows": rows, "parity": float(worst)}))
    dist.barrier()
    dist.destroy_process_group()


def worker(world: int, plan_path: str, out: str) -> None:
    spawn_ranks(_rank, world, plan_path, out)


# -- the parent: one launch per degree, the table ------------------------------------------------


def _run(world: int, plan: dict, tmp: Path) -> dict:
    return run_degree(__file__, world, plan, tmp)


def _plan(args) -> dict:
    """Attention in DeepSpeed's layout at every S; the exchange alone in both layouts, at b = 1
    and the longest S, and at b = 4 and half of it."""
    longest = max(args.seq)
    cases = [{"mode": "attention", "layout": "sbhd", "b": 1, "h": args.heads, "S": S, "repeats": args.repeats}
             for S in args.seq]
    cases += [{"mode": "exchange", "layout": layout, "b": b, "h": args.heads, "S": S, "repeats": 2 * args.repeats}
              for layout in LAYOUTS for b, S in ((1, longest), (4, longest // 2))]
    return {"cases": cases, "warmup": args.warmup, "deepspeed": ANCHOR_PY.exists()}


def table(rows: list[dict]) -> str:
    """Markdown: per case the median ms of each variant and meshspeed's ratio to DeepSpeed,
    the median over repeats of a meshspeed call over the DeepSpeed call of the same repeat
    (Note [what is timed])."""
    by_case: dict[tuple, dict[str, list[float]]] = {}
    for r in rows:
        key = (r["mode"], r["P"], r["layout"], r["b"], r["h"], r["S"])
        by_case.setdefault(key, {})[r["variant"]] = r["seconds"]
    head = f"| mode | P | layout | b | h | S | {DEEPSPEED} ms | {MESHSPEED} ms | ratio | {DEFAULT} ms | ratio "
    lines = [head + "| others' load |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    others = {(r["mode"], r["P"], r["layout"], r["b"], r["h"], r["S"]): r.get("others") for r in rows}
    for key in sorted(by_case, key=lambda k: (k[0] != "attention", *k)):
        seconds = by_case[key]
        ds = seconds.get(DEEPSPEED)
        cells = [str(x) for x in key]
        for name in (DEEPSPEED, MESHSPEED, DEFAULT):
            sec = seconds.get(name)
            cells.append("" if sec is None else f"{statistics.median(sec) * 1e3:.1f}")
            if name != DEEPSPEED:
                paired = None if sec is None or ds is None else statistics.median(m / d for m, d in zip(sec, ds, strict=True))
                cells.append("" if paired is None else f"{paired:.2f}x")
        cells.append("" if others[key] is None else f"{others[key]:.0%}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--degrees", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--seq", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, help="write every timing here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--degree", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--plan", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.degree, args.plan, args.out)
        return
    plan = _plan(args)
    if not plan["deepspeed"]:
        print(f"DeepSpeed skipped: its venv is missing ({ANCHOR_PY}; ../shared/tools/anchor-venv.sh builds it)")
    rows, parity = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for world in args.degrees:
            result = _run(world, plan, Path(tmp))
            rows += result["rows"]
            parity[world] = result["parity"]
    print("\n" + table(rows) + "\n")
    for world, worst in parity.items():
        print(f"P={world}: largest |meshspeed - DeepSpeed| over outputs and q/k/v gradients "
              f"(S=256, both layouts, every rank): {worst:.2e}")
    if args.json:
        args.json.write_text(json.dumps({"plan": plan, "rows": rows, "parity": parity}, indent=1))


if __name__ == "__main__":
    main()
