"""The host Adam step against the memory-bandwidth limit of this machine.

An Adam(W) step reads param, grad, exp_avg and exp_avg_sq and writes param, exp_avg and
exp_avg_sq: 7 fp32 values, 28 bytes per parameter, with a handful of flops each, so on a
CPU it is bound by memory bandwidth, not arithmetic. The best any implementation can do
is 28 bytes x parameters / (bandwidth). This script measures that bandwidth the way STREAM
does (Copy: 2 arrays moved; Triad and an in-place add: 3), then times the update kernels the offloaded
optimizer can use, over the same bytes, and reports GB/s achieved and the fraction of the
best measured bandwidth:

    .venv/bin/python benchmarks/adam.py --numel 32000000 --repeats 5

  fused       torch's fused CPU AdamW (meshspeed's default for offload; one pass)
  reference   torch's single-tensor AdamW (`"fused": false`; bit-for-bit torch.optim.AdamW)
  fused x1000 the fused kernel over the same elements cut into 1000 tensors (a sub-group of
              parameter slices, as the offloaded optimizer passes it)

Arrays are far larger than the last-level cache, first-touched before timing, and each
figure is the best of `--repeats`. Results go to docs/benchmarks.md (section "Host Adam").
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from meshspeed.offload.aio_bench import write_docs_section
from meshspeed.offload.kernels import AdamRule

OPTIONS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}


def best_time(fn, repeats: int) -> float:
    fn()  # warm-up (and first touch of any lazily created memory)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def stream(numel: int, repeats: int) -> dict[str, float]:
    a, b, c = (torch.ones(numel) for _ in range(3))
    copy = best_time(lambda: b.copy_(a), repeats)
    triad = best_time(lambda: torch.add(b, c, alpha=3.0, out=a), repeats)
    inplace = best_time(lambda: a.add_(b), repeats)
    nbytes = numel * 4
    return {"copy_GBps": 2 * nbytes / copy / 1e9, "triad_GBps": 3 * nbytes / triad / 1e9,
            "inplace_GBps": 3 * nbytes / inplace / 1e9}


def adam(numel: int, repeats: int, fused: bool, pieces: int = 1) -> dict[str, float]:
    rule = AdamRule(decoupled=True, fused=fused)
    flat = [torch.randn(numel) * 0.01 for _ in range(4)]  # param, grad, exp_avg, exp_avg_sq
    flat[3].abs_()
    bounds = [numel * i // pieces for i in range(pieces + 1)]
    split = [[t[a:b] for a, b in itertools.pairwise(bounds)] for t in flat]
    steps = [torch.zeros(()) for _ in range(pieces)]
    state = {"exp_avg": split[2], "exp_avg_sq": split[3]}

    def step():
        rule.step(split[0], split[1], state, steps, OPTIONS)

    t = best_time(step, repeats)
    return {"seconds": t, "GBps": 28 * numel / t / 1e9, "Mparams_per_s": numel / t / 1e6}


def run(numel: int, repeats: int, threads: int) -> dict:
    torch.set_num_threads(threads)
    bw = stream(numel, repeats)
    kernels = {
        "fused": adam(numel, repeats, fused=True),
        "reference": adam(numel, repeats, fused=False),
        "fused x1000": adam(numel, repeats, fused=True, pieces=1000),
    }
    limit = max(bw.values())
    for k in kernels.values():
        k["of_limit"] = k["GBps"] / limit
    return {"threads": threads, **bw, "kernels": kernels}


def report(results: list[dict], numel: int) -> str:
    lines = ["## Host Adam (benchmarks/adam.py)", "",
             (f"`{' '.join(['.venv/bin/python', 'benchmarks/adam.py', *sys.argv[1:]])}` on "
             f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch "
             f"{torch.__version__}; {numel / 1e6:.0f}M fp32 parameters (28 bytes each per step: "
             "read param, grad, m, v; write param, m, v). Best of the repeats."), "",
             "| threads | kernel | ms / step | GB/s | of measured bandwidth |",
             "|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['threads']} | *bandwidth: Copy / Triad / in-place add* | | "
                     f"{r['copy_GBps']:.1f} / {r['triad_GBps']:.1f} / {r['inplace_GBps']:.1f} | |")
        for name, k in r["kernels"].items():
            lines.append(f"| {r['threads']} | {name} | {k['seconds'] * 1e3:.1f} | {k['GBps']:.1f} | "
                         f"{k['of_limit']:.0%} |")
    lines += ["", ("Bandwidth is measured like STREAM: Copy `b = a` counts 2 arrays, Triad "
              "`a = b + 3c` and in-place add `a += b` count 3; \"of measured bandwidth\" is "
              "against the best of the three. Copy and Triad write to an array they do not "
              "read, which costs the CPU an extra read of each destination line "
              "(write-allocate) that STREAM does not count; Adam, like the in-place add, "
              "writes only lines it has read, so it can reach and even pass the Copy figure. "
              "The reference kernel makes about ten passes over memory (one per "
              "elementwise op) and is several times slower: it is for bit-exact comparisons."), ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=int, default=32_000_000, help="parameters per step")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, nargs="*", default=None,
                    help="intra-op thread counts to measure (default: 1 and all CPUs)")
    ap.add_argument("--out", default=str(REPO / "docs" / "benchmarks.md"))
    ap.add_argument("--json", default=str(REPO / "benchmarks" / "results" / "adam.json"))
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO / "benchmarks"))
    from zero_report import stamped  # lazy: benchmarks/ joins sys.path above

    stamped("", Path(args.out))  # refuse uncommitted code before the run, not after it
    threads = args.threads or sorted({1, torch.get_num_threads()})
    results = [run(args.numel, args.repeats, t) for t in threads]
    text = report(results, args.numel)
    print(text)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=1))
    write_docs_section(Path(args.out), "adam.py", stamped(text, Path(args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
