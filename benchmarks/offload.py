"""Resident memory and step time of one rank with the optimizer offloaded, against none.

    .venv/bin/python benchmarks/offload.py --nvme-path /tmp --steps 4

Trains the same GPT (fp32, AdamW, ZeRO stage 2, dp=2 gloo ranks on this machine) with
`offload_optimizer.device` none, cpu and nvme (and nvme with delayed_update), each in
fresh rank processes, and reports per rank: the resident set size (RSS) after the last
step, the optimizer-state bytes and where `memory_breakdown()` places them, the NVMe
file bytes, and the mean time of the timed steps. Expected: nvme's RSS is lower than
none's by about the optimizer state (8 bytes per owned parameter) minus the swap buffers
it keeps (`buffer_count` x `sub_group_size` x 4 bytes). On a CPU-only machine "cpu"
offload moves nothing (the CPU is the device: Note [offload on a CPU-only machine] in
meshspeed/offload/placement.py), so its RSS matches none's.

RSS is read from /proc/self/statm after `gc.collect()` and glibc's `malloc_trim(0)`
(freed temporaries would otherwise stay counted); every mode uses torch's fused AdamW
kernel, so the rows differ only in where the state lives; each mode runs in new processes
(a process's heap does not shrink back after a previous run). Writes a section of
docs/benchmarks.md and benchmarks/results/offload.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from meshspeed.offload.aio_bench import write_docs_section

MODEL = {"vocab_size": 256, "max_seq_len": 128, "n_layer": 8, "n_head": 8, "d_model": 512}


def measure(mode: str, nvme_path: str, steps: int, sub_group_size: int) -> dict:
    """Runs on every rank (meshspeed.testing.run_distributed)."""
    import meshspeed
    from meshspeed import comm
    from meshspeed.models.gpt import GPT, GPTConfig
    from meshspeed.process.accelerator import _rss_bytes, get_accelerator

    acc = get_accelerator("cpu")
    gc.collect()
    _trim_heap()
    acc.reset_peak_memory_stats()
    rss0 = _rss_bytes()

    zero = {"stage": 2, "sub_group_size": sub_group_size}
    if mode != "none":
        device, _, delayed = mode.partition("+")
        zero["offload_optimizer"] = {"device": device, "buffer_count": 4,
                                     "delayed_update": delayed == "delayed"}
        if device == "nvme":
            zero["offload_optimizer"]["nvme_path"] = nvme_path
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
              # the fused kernel in every mode: the rows differ in placement only
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "fused": True}},
              "zero_optimization": zero, "steps_per_print": 10**6}
    torch.manual_seed(0)
    model = GPT(GPTConfig(**MODEL))
    engine, *_ = meshspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    g = torch.Generator().manual_seed(comm.get_rank())
    tokens = torch.randint(0, MODEL["vocab_size"], (4, MODEL["max_seq_len"] + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    times = []
    for i in range(steps + 1):  # the first step allocates the state: untimed
        t = time.perf_counter()
        engine.backward(engine(x, y))
        engine.step()
        if i:
            times.append(time.perf_counter() - t)
    getattr(engine.strategy, "wait", lambda: None)()
    gc.collect()
    _trim_heap()
    rss = _rss_bytes()
    peak = acc.max_memory_allocated()
    mem = engine.memory_breakdown()
    owned = sum(s.end - s.start for s in engine.strategy.owned_slices() if s.requires_grad)
    from meshspeed.offload import close

    close(engine)
    return {"mode": mode, "rss": rss, "rss_start": rss0, "peak_rss": peak, "step_s": sum(times) / len(times), "owned": owned,
            "optimizer_state": mem["optimizer_state"], "tiers": mem["tiers"],
            "params": sum(p.numel() for p in model.parameters())}


def _trim_heap() -> None:
    """Give freed heap pages back to the OS (glibc keeps them otherwise), so that RSS
    tracks live memory rather than the history of temporaries."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def report(rows: list[dict], args) -> str:
    none = rows[0]
    pool = 4 * args.sub_group_size * 4
    lines = ["## Optimizer offload: memory and step time (benchmarks/offload.py)", "",
             (f"`.venv/bin/python benchmarks/offload.py --nvme-path {args.nvme_path} --steps "
             f"{args.steps} --sub-group-size {args.sub_group_size}`: GPT with "
             f"{none['params'] / 1e6:.1f}M parameters, fp32, AdamW, ZeRO stage 2, dp=2 on this "
             f"machine; rank 0 shown. Adam's state for the {none['owned'] / 1e6:.2f}M parameters "
             f"this rank owns is {8 * none['owned'] / 2**20:.1f} MiB; the NVMe swap buffers are "
             f"{pool / 2**20:.1f} MiB (4 x sub_group_size x 4 bytes)."), "",
             "| offload_optimizer | RSS MiB | RSS vs none MiB | optimizer state: device / host / nvme MiB | step s |",
             "|---|---|---|---|---|"]
    for r in rows:
        t = r["tiers"]
        state = r["optimizer_state"]
        where = {"none": (state, 0, 0)}.get(r["mode"].split("+")[0], None)
        if where is None:
            nv = t["nvme"]
            where = (0, state - nv, nv)
        lines.append(f"| {r['mode']} | {r['rss'] / 2**20:.0f} | {(r['rss'] - none['rss']) / 2**20:+.0f} | "
                     + " / ".join(f"{b / 2**20:.1f}" for b in where) + f" | {r['step_s']:.2f} |")
    nvme = next((r for r in rows if r["mode"] == "nvme"), None)
    if nvme is not None:
        drop = (none["rss"] - nvme["rss"]) / 2**20
        expect = (8 * none["owned"] - pool) / 2**20
        lines += ["", (f"NVMe offload lowers this rank's RSS by {drop:.0f} MiB; the optimizer "
                  f"state minus the swap buffers is {expect:.0f} MiB ({drop / expect:.0%}).")]
    lines += ["", ("On this CPU-only machine the \"cpu\" row moves nothing (the CPU is the compute "
              "device), so it only relabels the state as host tier. The nvme step time includes "
              "reading and writing the whole optimizer state once per step. delayed_update keeps "
              "a separate fp32 copy of the masters (the next forward must not see the running "
              f"update: {4 * none['owned'] / 2**20:.0f} MiB here, in the host tier) and holds "
              "step N's gradients while step N+1's backward makes new ones; its host step "
              "overlaps the next forward and backward, which pays off when the device is an "
              "accelerator (here the ranks and the update share 2 cores). Step times come "
              "from a machine that other jobs share and are indicative only; RSS is not "
              "affected by that."), ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nvme-path", default="/tmp")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--sub-group-size", type=int, default=1_000_000)
    ap.add_argument("--modes", nargs="+", default=["none", "cpu", "nvme", "nvme+delayed"])
    ap.add_argument("--out", default=str(REPO / "docs" / "benchmarks.md"))
    ap.add_argument("--json", default=str(REPO / "benchmarks" / "results" / "offload.json"))
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO / "benchmarks"))
    from zero_report import stamped  # lazy: benchmarks/ joins sys.path above

    stamped("", Path(args.out))  # refuse uncommitted code before the run, not after it
    from meshspeed.testing import close_pools, run_distributed

    rows = []
    for mode in args.modes:
        rows.append(run_distributed(measure, world_size=2, timeout=900,
                                    args=(mode, args.nvme_path, args.steps, args.sub_group_size))[0])
        close_pools()  # fresh processes for the next mode
        print(f"{mode}: rss {rows[-1]['rss'] / 2**20:.0f} MiB, {rows[-1]['step_s']:.2f} s/step",
              flush=True)
    text = report(rows, args)
    print(text)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(rows, indent=1))
    write_docs_section(Path(args.out), "offload.py", stamped(text, Path(args.out)))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
