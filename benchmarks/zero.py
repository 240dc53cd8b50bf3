"""ZeRO stages 0-3 against torch DDP, torch FSDP2 and (when importable) DeepSpeed.

One command trains the same GPT (same seed, same data, fp32, AdamW) with every framework
on N gloo ranks of this machine, one intra-op thread per rank, and writes step time, peak
RSS and model-state bytes per rank as ratios against DDP:

    .venv/bin/python benchmarks/zero.py --steps 30 --warmup 5

Note [one spawn per framework]
A process's peak RSS never goes down, and glibc keeps freed heap pages, so frameworks that
share processes would inherit each other's peaks. Each framework therefore runs in fresh
rank processes, and each rank also resets its peak (`/proc/self/clear_refs`, "5") just
before it builds the model: `peak RSS` is the process's whole high-water mark,
`peak RSS delta` the part above what the process held once torch and the process group
were up. Rank 0 gathers every rank's numbers and hands them to the parent, which writes
the report.

Note [what counts as model state]
Bytes of parameters, gradients and optimizer state resident on a rank, counted from the
tensors themselves (each storage once, `meshspeed.engine.memory.count_bytes`), taken after
the backward and before the optimizer step of one extra, untimed step: the moment all
three exist. meshspeed reports its own (`engine.memory_breakdown()`, gathered stage-3
parameters excluded: they are released after backward). For DDP and FSDP2 we count
`p`, `p.grad` and the optimizer state, through `.to_local()` for FSDP2's DTensors. DDP's
reducer keeps its own flat gradient buckets (Ψ·4 bytes more with the default
`gradient_as_bucket_view=False`); torch does not expose them, so they show in RSS only.

`--profile FRAMEWORK` instead runs torch.profiler on rank 0 for a few steps of one
framework and prints the ops with the largest self CPU time.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parent.parent
# meshspeed-3-t0: stage 3 with stage3_param_persistence_threshold 0, so that every parameter
# is sharded as FSDP2 shards it (the default, 1e5 as in DeepSpeed, keeps small ones whole).
MESHSPEED = [*(f"meshspeed-{s}" for s in range(4)), "meshspeed-3-t0"]
DEEPSPEED = [f"deepspeed-{s}" for s in (1, 2, 3)]
ALL = ["ddp", *MESHSPEED, "fsdp2", *DEEPSPEED]


@dataclass(frozen=True)
class Setup:
    """Everything that must be equal across frameworks for the comparison to mean anything."""

    vocab_size: int = 256  # byte-level tokens
    d_model: int = 256  # residual width
    n_layer: int = 6  # transformer blocks (= FSDP2 / stage-3 units)
    n_head: int = 8
    seq_len: int = 128
    micro_batch: int = 8  # sequences per rank per step
    lr: float = 3e-4
    seed: int = 1234
    warmup: int = 5  # untimed steps first
    steps: int = 30  # timed steps


# -- data ---------------------------------------------------------------------------------------


def make_batches(setup: Setup, world: int, rank: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`count` (x, y) micro-batches for this rank: byte windows of the Python standard library
    at offsets drawn from one seeded generator, so every framework sees the same data."""
    from meshspeed.data.corpus import stdlib_corpus

    data = torch.frombuffer(bytearray(stdlib_corpus(max_bytes=1_000_000)), dtype=torch.uint8)
    gen = torch.Generator().manual_seed(setup.seed)
    starts = torch.randint(0, len(data) - setup.seq_len - 1, (count, world, setup.micro_batch), generator=gen)
    out = []
    for step in range(count):
        rows = torch.stack([data[s : s + setup.seq_len + 1] for s in starts[step, rank].tolist()]).long()
        out.append((rows[:, :-1].contiguous(), rows[:, 1:].contiguous()))  # (B, T) each
    return out


def build_model(setup: Setup):
    from meshspeed.models.gpt import GPT, GPTConfig

    torch.manual_seed(setup.seed)  # identical initial weights on every rank and framework
    cfg = GPTConfig(vocab_size=setup.vocab_size, max_seq_len=setup.seq_len, n_layer=setup.n_layer,
                    n_head=setup.n_head, d_model=setup.d_model)
    return GPT(cfg)


# -- frameworks: each yields forward_backward(x, y) -> loss, optimizer_step(), state_bytes() -------


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _torch_state_bytes(model, optimizer) -> dict[str, int]:
    from meshspeed.engine.memory import count_bytes, optimizer_state_tensors

    params = list(model.parameters())
    counted = count_bytes({
        "params": [_local(p.detach()) for p in params],
        "grads": [_local(p.grad) for p in params if p.grad is not None],
        "optimizer_state": [_local(t) for t in optimizer_state_tensors(optimizer)],
    })
    return {k: counted[k] for k in ("params", "grads", "optimizer_state")}


class TorchTrainer:
    def __init__(self, model, wrapped, setup: Setup):
        self.model, self.wrapped = model, wrapped
        self.opt = torch.optim.AdamW(model.parameters(), lr=setup.lr)  # weight_decay 0.01, as meshspeed

    def forward_backward(self, x, y):
        loss = self.wrapped(x, y)
        loss.backward()
        return loss

    def optimizer_step(self):
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def state_bytes(self):
        return _torch_state_bytes(self.model, self.opt)


class MeshspeedTrainer:
    def __init__(self, model, setup: Setup, stage: int, deepspeed: bool = False,
                 persistence_threshold: int | None = None):
        lib = importlib.import_module("deepspeed" if deepspeed else "meshspeed")
        config = {
            "train_micro_batch_size_per_gpu": setup.micro_batch,
            "optimizer": {"type": "AdamW", "params": {"lr": setup.lr, "weight_decay": 0.01}},
            "zero_optimization": {"stage": stage},
            "steps_per_print": 10**9,
        }
        if persistence_threshold is not None:
            config["zero_optimization"]["stage3_param_persistence_threshold"] = persistence_threshold
        self.engine, *_ = lib.initialize(model=model, model_parameters=model.parameters(), config=config)
        self.deepspeed = deepspeed

    def forward_backward(self, x, y):
        loss = self.engine(x, y)
        self.engine.backward(loss)
        return loss

    def optimizer_step(self):
        self.engine.step()

    def state_bytes(self):
        if self.deepspeed:  # DeepSpeed has no per-category accounting we trust; count tensors
            return {"params": -1, "grads": -1, "optimizer_state": -1}
        b = self.engine.memory_breakdown()
        return {"params": b["params"] + b["master_params"], "grads": b["grads"],
                "optimizer_state": b["optimizer_state"]}


def make_trainer(name: str, setup: Setup, world: int):
    model = build_model(setup)
    if name == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return TorchTrainer(model, DDP(model), setup)
    if name == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return TorchTrainer(model, model, setup)
    kind, stage, *variant = name.split("-")
    threshold = 0 if variant == ["t0"] else None
    return MeshspeedTrainer(model, setup, int(stage), deepspeed=kind == "deepspeed",
                            persistence_threshold=threshold)


# -- one rank -----------------------------------------------------------------------------------


def _status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return -1


def _reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


@dataclass
class RankResult:
    step_s: list[float] = field(default_factory=list)  # wall clock
    cpu_s: list[float] = field(default_factory=list)  # CPU time of the process (all threads)
    losses: list[float] = field(default_factory=list)
    baseline_rss_kb: int = 0
    peak_rss_kb: int = 0
    state: dict[str, int] = field(default_factory=dict)
    peak_reset: bool = False


def _timed_steps(trainer, batches, setup: Setup, res: RankResult) -> None:
    for i, (x, y) in enumerate(batches[: setup.warmup + setup.steps]):
        dist.barrier()  # start every step together; the barrier itself is not timed
        t0, c0 = time.perf_counter(), time.process_time()
        loss = trainer.forward_backward(x, y)
        trainer.optimizer_step()
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
        res.losses.append(float(loss.detach()))
        if i >= setup.warmup:
            res.step_s.append(elapsed)
            res.cpu_s.append(cpu)


def _profile_steps(trainer, batches, setup: Setup, steps: int) -> str | None:
    from torch.profiler import ProfilerActivity, profile

    for x, y in batches[: setup.warmup]:
        trainer.forward_backward(x, y)
        trainer.optimizer_step()
    active = dist.get_rank() == 0
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) if active else _null() as prof:
        for x, y in batches[setup.warmup : setup.warmup + steps]:
            trainer.forward_backward(x, y)
            trainer.optimizer_step()
    if not active:
        return None
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60)


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def rank_main(rank: int, world: int, port: int, name: str, setup: Setup, out_file: str,
              profile_steps: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        batches = make_batches(setup, world, rank, setup.warmup + max(setup.steps, profile_steps) + 1)
        gc.collect()
        res = RankResult(peak_reset=_reset_peak_rss(), baseline_rss_kb=_status_kb("VmRSS"))
        trainer = make_trainer(name, setup, world)
        if profile_steps:
            table = _profile_steps(trainer, batches, setup, profile_steps)
            if table is not None:
                Path(out_file).write_text(table)
            return
        _timed_steps(trainer, batches, setup, res)
        x, y = batches[setup.warmup + setup.steps]  # one more, untimed, to count model state
        trainer.forward_backward(x, y)
        res.state = trainer.state_bytes()
        trainer.optimizer_step()
        res.peak_rss_kb = _status_kb("VmHWM")
        gathered = [None] * world
        dist.all_gather_object(gathered, asdict(res))
        if rank == 0:
            Path(out_file).write_text(json.dumps(gathered))
    finally:
        dist.barrier()
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(name: str, setup: Setup, world: int, profile_steps: int = 0):
    """Run one framework in `world` fresh processes; returns rank 0's file contents."""
    with tempfile.TemporaryDirectory() as tmp:
        out_file = os.path.join(tmp, "result")
        mp.spawn(rank_main, args=(world, _free_port(), name, setup, out_file, profile_steps),
                 nprocs=world, join=True)
        text = Path(out_file).read_text()
    return text if profile_steps else json.loads(text)


# -- report -------------------------------------------------------------------------------------


def machine_description() -> dict[str, str]:
    cpu = platform.processor() or "unknown CPU"
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                cpu = line.split(":", 1)[1].strip()
    except OSError:
        pass
    mem_kb = next((int(l.split()[1]) for l in Path("/proc/meminfo").read_text().splitlines()
                   if l.startswith("MemTotal:")), 0)
    try:
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "meshspeed"],
                               capture_output=True, text=True).stdout.strip()
        commit += " (meshspeed/ has uncommitted changes)" if dirty else ""
    except OSError:
        commit = "unknown"
    return {
        "cpu": f"{cpu}, {os.cpu_count()} logical CPUs",
        "memory": f"{mem_kb / 2**20:.1f} GiB",
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "meshspeed commit": commit or "unknown",
    }


def summarise(name: str, ranks: list[dict]) -> dict:
    r0 = ranks[0]
    state = [sum(r["state"].values()) for r in ranks]
    return {
        "framework": name,
        "median_step_s": statistics.median(r0["step_s"]),
        "median_step_s_per_rank": [statistics.median(r["step_s"]) for r in ranks],
        "median_cpu_s_per_rank": [statistics.median(r["cpu_s"]) for r in ranks],
        "step_s": r0["step_s"],
        "peak_rss_mib": max(r["peak_rss_kb"] for r in ranks) / 1024,
        "peak_rss_delta_mib": max(r["peak_rss_kb"] - r["baseline_rss_kb"] for r in ranks) / 1024,
        "model_state_bytes": max(state),
        "model_state_by_category": ranks[0]["state"],
        "losses": r0["losses"],
        "peak_reset": all(r["peak_reset"] for r in ranks),
    }


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b > 0 and a >= 0 else "n/a"


def targets(rows: dict[str, dict], psi: int, world: int) -> list[tuple[str, str, str]]:
    """(target, measured, verdict) for the goals issue 3 sets."""
    out = []
    ddp = rows.get("ddp")
    for s in (1, 2):
        r = rows.get(f"meshspeed-{s}")
        if r and ddp:
            rel = r["median_step_s"] / ddp["median_step_s"] - 1
            out.append((f"stage {s} step time within 5% of DDP", f"{rel:+.1%}", "met" if rel <= 0.05 else "not met"))
    for z3_name in ("meshspeed-3", "meshspeed-3-t0"):
        z3 = rows.get(z3_name)
        if not z3:
            continue
        for other in ("fsdp2", "deepspeed-3"):
            r = rows.get(other)
            if r:
                faster = 1 - z3["median_step_s"] / r["median_step_s"]
                out.append((f"{z3_name} at least 15% faster than {other}", f"{faster:+.1%} faster",
                            "met" if faster >= 0.15 else "not met"))
        ideal = 16 * psi / world
        rel = z3["model_state_bytes"] / ideal - 1
        out.append((f"{z3_name} model state within 5% of 16Ψ/N",
                    f"{z3['model_state_bytes'] / 2**20:.2f} MiB vs {ideal / 2**20:.2f} MiB ({rel:+.1%})",
                    "met" if abs(rel) <= 0.05 else "not met"))
    return out


def render_markdown(rows: dict[str, dict], setup: Setup, world: int, psi: int, command: str,
                    machine: dict[str, str], skipped: dict[str, str]) -> str:
    ddp = rows["ddp"]
    lines = [
        "# Benchmarks",
        "",
        "## ZeRO stages against DDP, FSDP2 and DeepSpeed (`benchmarks/zero.py`)",
        "",
        f"GPT with Ψ = {psi:,} parameters (vocab {setup.vocab_size}, d_model {setup.d_model}, "
        f"{setup.n_layer} layers, {setup.n_head} heads, sequence {setup.seq_len}), fp32, AdamW "
        f"(lr {setup.lr}, weight decay 0.01), micro-batch {setup.micro_batch} per rank, "
        f"{world} ranks on gloo, one intra-op thread per rank. Same seed and the same byte windows "
        "of the Python standard library for every framework. Each framework runs in fresh "
        "processes (Note [one spawn per framework] in the script). "
        f"Median over {setup.steps} timed steps after {setup.warmup} warm-up steps, rank 0.",
        "",
        "Command:",
        "",
        "```",
        command,
        "```",
        "",
        "Machine: " + "; ".join(f"{k} {v}" for k, v in machine.items()) + ".",
        "",
        "| framework | median step (s) | step vs DDP | peak RSS / rank (MiB) | RSS vs DDP "
        "| peak RSS above baseline (MiB) | vs DDP | model state / rank (MiB) | vs DDP |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        lines.append(
            f"| {name} | {r['median_step_s']:.3f} | {_ratio(r['median_step_s'], ddp['median_step_s'])} "
            f"| {r['peak_rss_mib']:.0f} | {_ratio(r['peak_rss_mib'], ddp['peak_rss_mib'])} "
            f"| {r['peak_rss_delta_mib']:.0f} | {_ratio(r['peak_rss_delta_mib'], ddp['peak_rss_delta_mib'])} "
            f"| {r['model_state_bytes'] / 2**20:.2f} | {_ratio(r['model_state_bytes'], ddp['model_state_bytes'])} |"
        )
    for name, why in skipped.items():
        lines.append(f"| {name} | skipped: {why} | | | | | | | |")
    lines += [
        "",
        f"Model state = params + grads + optimizer state resident on the rank (the larger of the "
        f"ranks), counted from the tensors after backward and before the optimizer step. For "
        f"reference, 16Ψ = {16 * psi / 2**20:.2f} MiB and 16Ψ/N = {16 * psi / world / 2**20:.2f} MiB. "
        "DDP's own gradient buckets (another 4Ψ) are not reachable from Python and are not in "
        "its model-state column; they are in its RSS.",
        "",
        "Model state by category (rank 0, MiB):",
        "",
        "| framework | params | grads | optimizer state |",
        "|---|---|---|---|",
    ]
    for name, r in rows.items():
        c = r["model_state_by_category"]
        lines.append(f"| {name} | {c['params'] / 2**20:.2f} | {c['grads'] / 2**20:.2f} "
                     f"| {c['optimizer_state'] / 2**20:.2f} |")
    lines += ["", "### Targets", "", "| target | measured | verdict |", "|---|---|---|"]
    lines += [f"| {t} | {m} | {v} |" for t, m, v in targets(rows, psi, world)]
    lines += ["", "### Losses (rank 0, first 5 steps)", "",
              "All frameworks are fp32 with the same weights and data: they should agree to "
              "float rounding for the first steps.", "",
              "| framework | " + " | ".join(f"step {i}" for i in range(5)) + " | max abs diff vs DDP (all steps) |",
              "|---|" + "---|" * 6]
    for name, r in rows.items():
        diff = max(abs(a - b) for a, b in zip(r["losses"], ddp["losses"]))
        lines.append(f"| {name} | " + " | ".join(f"{l:.6f}" for l in r["losses"][:5]) + f" | {diff:.2e} |")
    return "\n".join(lines) + "\n"


def write_docs(section: str, path: Path) -> None:
    """Replace this benchmark's section of docs/benchmarks.md, keeping any others."""
    marker_start, marker_end = "<!-- zero.py:start -->", "<!-- zero.py:end -->"
    block = f"{marker_start}\n{section.split(chr(10), 2)[2]}{marker_end}\n"
    old = path.read_text() if path.exists() else "# Benchmarks\n\n"
    if marker_start in old and marker_end in old:
        head, rest = old.split(marker_start, 1)
        new = head + block + rest.split(marker_end, 1)[1].lstrip("\n")
    else:
        new = old.rstrip("\n") + "\n\n" + block
    path.write_text(new)


# -- entry point --------------------------------------------------------------------------------


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--frameworks", default=",".join(ALL),
                    help=f"comma-separated subset of {','.join(ALL)} (ddp is always run: it is the baseline)")
    ap.add_argument("--steps", type=int, default=30, help="timed steps")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps before timing")
    ap.add_argument("--nproc", type=int, default=2, help="ranks (processes)")
    ap.add_argument("--micro-batch", type=int, default=Setup.micro_batch)
    ap.add_argument("--out", default=str(REPO / "docs" / "benchmarks.md"), help="markdown report")
    ap.add_argument("--json", default=str(REPO / "benchmarks" / "results" / "zero.json"))
    ap.add_argument("--profile", metavar="FRAMEWORK", choices=ALL,
                    help="profile a few steps of one framework on rank 0 instead of benchmarking")
    ap.add_argument("--profile-steps", type=int, default=5)
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    setup = Setup(warmup=args.warmup, steps=args.steps, micro_batch=args.micro_batch)
    has_deepspeed = importlib.util.find_spec("deepspeed") is not None
    if args.profile:
        print(spawn(args.profile, setup, args.nproc, profile_steps=args.profile_steps))
        return
    wanted = ["ddp"] + [f for f in args.frameworks.split(",") if f and f != "ddp"]
    unknown = [f for f in wanted if f not in ALL]
    if unknown:
        sys.exit(f"unknown framework(s) {unknown}; choose from {ALL}")
    rows, skipped = {}, {}
    for name in wanted:
        if name.startswith("deepspeed") and not has_deepspeed:
            skipped[name] = "deepspeed is not importable"
            continue
        t0 = time.time()
        rows[name] = summarise(name, spawn(name, setup, args.nproc))
        r = rows[name]
        print(f"{name:14s} step {r['median_step_s']:.3f}s (cpu {r['median_cpu_s_per_rank'][0]:.3f}s)  peak RSS {r['peak_rss_mib']:.0f} MiB "
              f"(+{r['peak_rss_delta_mib']:.0f})  state {r['model_state_bytes'] / 2**20:.2f} MiB  "
              f"loss0 {r['losses'][0]:.6f}  [{time.time() - t0:.0f}s]", flush=True)
    psi = build_model(setup).config.num_params()
    command = " ".join([".venv/bin/python", "benchmarks/zero.py", *(argv if argv is not None else sys.argv[1:])])
    machine = machine_description()
    section = render_markdown(rows, setup, args.nproc, psi, command, machine, skipped)
    write_docs(section, Path(args.out))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({
        "command": command, "machine": machine, "setup": asdict(setup), "world": args.nproc,
        "psi": psi, "results": rows, "skipped": skipped,
        "targets": [dict(zip(("target", "measured", "verdict"), t)) for t in targets(rows, psi, args.nproc)],
    }, indent=1))
    print(f"wrote {args.out} and {args.json}")


if __name__ == "__main__":
    main()
