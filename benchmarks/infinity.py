"""ZeRO-Infinity in one process: host memory per parameter with everything on NVMe.

    PYTHONPATH=. .venv/bin/python benchmarks/infinity.py --params 0.1e9 --steps 3

Builds the reference GPT (`meshspeed.models.gpt.GPT`) of about `--params` parameters
under `meshspeed.zero.Init` in bf16, ZeRO stage 3 with `offload_optimizer` and
`offload_param` both on nvme (a temporary directory under `--nvme-path`), and trains
`--steps` steps on one fixed batch (world 1, no launcher). Reports, as one JSON line
(and a table on stderr):

- peak RSS: VmHWM from /proc/self/status at the end, and the largest of RSS samples
  taken every `--sample-ms` by a thread during the run, split into phases (build,
  initialize, each step's forward+backward and optimizer step);
- `engine.memory_breakdown()` (categories and tiers) after the last step;
- bytes of the swap files on disk (walked, not asked of the strategy);
- loss and time per step;
- at steady state (over the steps after the first: a step's updates may run on into the
  next forward, Note [bytes per step with updates in the forward]), the bytes per step,
  the fraction of the step, and of its
  forward+backward and optimizer phases, during which a swap request was in flight (the
  disk had work), and the bytes that went direct and through the page cache, with which
  files and why (`disk`).

Bytes per parameter = peak RSS / parameters, with the RSS of the interpreter and torch
before the build subtracted (`rss_start`). The issue-18 target is a peak that depends
on the config's buffer bounds and one unit's size, not on the model's size: compare two
sizes, (peak_b - peak_a) / (params_b - params_a) is the marginal host bytes per parameter.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
import cpu_time  # benchmarks/ joins sys.path above


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def hwm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


class RssSampler:
    """A thread sampling RSS; `phase(name)` starts attributing samples to `name`."""

    def __init__(self, period_s: float):
        self.period_s = period_s
        self.peaks: dict[str, int] = {}
        self._phase = "start"
        self.seconds: dict[str, float] = {}  # wall time spent in each phase
        self._since = time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def phase(self, name: str) -> None:
        self._note()
        now = time.perf_counter()
        self.seconds[self._phase] = self.seconds.get(self._phase, 0.0) + now - self._since
        self._phase, self._since = name, now
        self._note()

    def _note(self) -> None:
        rss = rss_bytes()
        self.peaks[self._phase] = max(self.peaks.get(self._phase, 0), rss)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self._note()

    @property
    def peak(self) -> int:
        return max(self.peaks.values())


def gpt_config(params: float, vocab: int, seq: int, d_model: int | None = None):
    """A GPT of about `params` parameters: width by size (or `d_model`), depth to fill the rest."""
    from meshspeed.models.gpt import GPTConfig

    d = d_model or (512 if params <= 0.12e9 else 768 if params <= 0.4e9 else 1024 if params <= 1e9 else 2048)
    per_block = 12 * d * d  # attention 4 d^2 + SwiGLU 3 * d * (8/3 d)
    n_layer = max(1, round((params - 2 * vocab * d) / per_block))
    return GPTConfig(vocab_size=vocab, max_seq_len=seq, n_layer=n_layer, n_head=d // 64, d_model=d)


def ds_config(args, nvme: str) -> dict:
    """Stage 3 with both offloads on nvme. With `--tutorial-config`, DeepSpeed's ZeRO-Infinity
    tutorial config: no buffer setting, initialize chooses them from the model and
    MemAvailable (Note [defaults that fit]); otherwise the command line's."""
    zero = {"stage": 3,
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme, **_in_cpu(args.optimizer_in_cpu),
                                  **({} if args.update_in_backward else {"update_in_backward": False}),
                                  **({} if args.update_into_forward is None
                                     else {"update_into_forward": args.update_into_forward})},
            "offload_param": {"device": "nvme", "nvme_path": nvme, **_in_cpu(args.param_in_cpu)}}
    if not args.tutorial_config:
        zero.update(sub_group_size=args.sub_group_size, stage3_prefetch_bucket_size=args.prefetch,
                    stage3_max_live_parameters=args.max_live)
        zero["offload_optimizer"]["buffer_count"] = args.buffer_count
        zero["offload_param"].update(buffer_count=args.param_buffer_count, buffer_size=args.param_buffer_size)
    return {
        "train_micro_batch_size_per_gpu": args.micro,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**6,
        "bf16": {"enabled": True},
        "aio": {"thread_count": args.aio_threads, "queue_depth": 8},
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.0}},
        "zero_optimization": zero,
    }


def chosen_settings(engine) -> dict:
    """The buffer settings the engine runs with (the user's or those initialize chose)."""
    z = engine.config.zero_optimization
    return {"sub_group_size": z.sub_group_size, "stage3_max_live_parameters": z.stage3_max_live_parameters,
            "stage3_prefetch_bucket_size": z.stage3_prefetch_bucket_size,
            "offload_optimizer.buffer_count": z.offload_optimizer.buffer_count,
            "offload_param.buffer_count": z.offload_param.buffer_count,
            "offload_param.buffer_size": z.offload_param.buffer_size}


def _in_cpu(elements: float | None) -> dict:
    """max_in_cpu when given; unset: the residency budget from MemAvailable (offload/residency.py)."""
    return {} if elements is None else {"max_in_cpu": int(elements)}


def swap_bytes(root: str | list[str]) -> int:
    total = 0
    for d, _, files in (w for r in ([root] if isinstance(root, str) else root) for w in os.walk(r)):
        for f in files:
            total += os.path.getsize(os.path.join(d, f))
    return total


def _build(args, cfg, sampler, nvme: str, phase: str = ""):
    import meshspeed
    from meshspeed.models.gpt import GPT

    sampler.phase(f"{phase}build")
    torch.manual_seed(0)
    # the config's offload_param.device "nvme" sends the chunks to a file as they are cut
    # (Note [building straight to NVMe] in meshspeed/parallel/zero/init_spill.py)
    with meshspeed.zero.Init(dtype=torch.bfloat16, config_dict_or_path=ds_config(args, nvme)):
        model = GPT(cfg)
    sampler.phase(f"{phase}initialize")
    engine, *_ = meshspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=ds_config(args, nvme))
    return model, engine


def _batch(args, cfg, rank: int):
    """This rank's rows of one fixed global batch (the same every step)."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (args.micro * args.world, args.seq + 1), generator=g)
    rows = tokens[rank * args.micro : (rank + 1) * args.micro]
    return rows[:, :-1], rows[:, 1:]


def _step(engine, x, y, sampler, name: str) -> tuple[float, float, dict]:
    """One step: its loss, seconds, and the swap engines' counters moved during it, whole
    and per phase ("fwd_bwd." / "optimizer." keys, with each phase's seconds)."""
    from meshspeed import comm
    from meshspeed.offload.aio import io_totals

    before, cpu0 = io_totals(), cpu_time.cpu_seconds()
    t = time.perf_counter()
    sampler.phase(f"{name}.fwd_bwd")
    loss = engine(x, y)
    engine.backward(loss)
    middle, t_mid, cpu1 = io_totals(), time.perf_counter(), cpu_time.cpu_seconds()
    sampler.phase(f"{name}.optimizer")
    engine.step()
    t_end = time.perf_counter()
    dt = t_end - t
    after, cpu2 = io_totals(), cpu_time.cpu_seconds()
    mean = loss.detach().float().clone()
    comm.all_reduce(mean)  # the global mean loss, the same on every rank
    moved = {k: after[k] - before[k] for k in after}
    moved.update({f"fwd_bwd.{k}": middle[k] - before[k] for k in after})
    moved.update({f"optimizer.{k}": after[k] - middle[k] for k in after})
    moved.update({"fwd_bwd.s": t_mid - t, "optimizer.s": t_end - t_mid})
    moved["cpu"] = {"step": cpu_time.moved(cpu0, cpu2), "fwd_bwd": cpu_time.moved(cpu0, cpu1),
                    "optimizer": cpu_time.moved(cpu1, cpu2)}  # run() keeps it apart from the bytes
    return float(mean) / comm.get_world_size(), dt, moved


# Note [bytes per step with updates in the forward]
# A step's updates may run on into the next forward (Note [the update that runs into the
# next forward] in meshspeed/offload/optimizer.py): one step's counters then hold part of
# the last step's work and leave part of their own to the next, by an amount that changes
# from step to step. The bytes per step are therefore counted from the start of step 1 to
# a `settle()` after the last step (which waits for the work it left), over the steps
# after the first; that includes what step 0 left to step 1 (a few sub-groups: step 0
# leaves none on purpose, it has not measured the pace yet), so it errs high, and the I/O
# bound with it. The busy fraction is the mean over the same steps' own windows.


def steady(r: dict) -> tuple[dict, float]:
    """A rank's swap counters and seconds per step at steady state, over the steps after the
    first: bytes from `io_steady` where the run has it, busy seconds and phases as the mean
    of those steps' own windows (Note [bytes per step with updates in the forward])."""
    ios, times = r["io_bytes"][1:] or r["io_bytes"], r["step_s"][1:] or r["step_s"]
    mean = {k: sum(io[k] for io in ios) / len(ios) for k in ios[0]}
    for k, v in r.get("io_steady", {}).items():
        if k != "busy_s":
            mean[k] = v
    return mean, sum(times) / len(times)


# Note [a step bound by the cores]
# The disk-busy fraction says how much of the step the disk had work; what the rest of the
# step waited for is the cores. Over a step, the process's CPU seconds (every thread:
# forward and backward compute, the optimizer's Adam and copies, the swap engine's
# threads, gloo) over the step's wall seconds times the machine's cores is how busy the
# cores were with it. Near 1.0, the step is bound by the cores: the disk can only be busy
# as much of the step as the disk's work is of the cores' (disk seconds / CPU-bound
# seconds), however the two are overlapped, and less CPU work per step is what moves it.


def cpu_report(ranks: list[dict], cores: int) -> dict:
    """At steady state (the steps after the first), per rank: the fraction of the machine's
    cores this process kept busy during the step and each phase (CPU seconds over wall
    seconds times `cores`), and the CPU seconds per step of the threads that spent the
    most (Note [a step bound by the cores] in benchmarks/infinity.py)."""
    out: dict = {"cores": cores, "busy_fraction_per_rank": [], "fwd_bwd_busy_fraction_per_rank": [],
                 "optimizer_busy_fraction_per_rank": [], "seconds_per_step_by_thread": []}
    for r in ranks:
        cpus, ios = r["cpu_s"][1:] or r["cpu_s"], r["io_bytes"][1:] or r["io_bytes"]
        steps = r["step_s"][1:] or r["step_s"]
        out["busy_fraction_per_rank"].append(
            round(sum(c["step"]["total"] for c in cpus) / (sum(steps) * cores), 2))
        for phase in ("fwd_bwd", "optimizer"):
            wall = sum(io[f"{phase}.s"] for io in ios)
            out[f"{phase}_busy_fraction_per_rank"].append(
                round(sum(c[phase]["total"] for c in cpus) / max(wall * cores, 1e-9), 2))
        names = {k for c in cpus for k in c["step"]}
        per = {k: sum(c["step"].get(k, 0.0) for c in cpus) / len(cpus) for k in names}
        out["seconds_per_step_by_thread"].append(
            {k: round(v, 1) for k, v in sorted(per.items(), key=lambda kv: -kv[1]) if v >= 0.05})
    return out


def disk_report(ranks: list[dict]) -> dict:
    """At steady state (`steady`), per rank: the disk-busy fraction of the step and of
    each phase (a request of this process in flight), and the bytes that went direct and
    through the page cache, with which files and why (Note [O_DIRECT where it fits] in
    aio.py)."""
    out: dict = {"busy_fraction_per_rank": [], "fwd_bwd_busy_fraction_per_rank": [],
                 "optimizer_busy_fraction_per_rank": [], "direct_gb": 0.0, "buffered_gb": 0.0}
    for r in ranks:
        io, step = steady(r)
        out["busy_fraction_per_rank"].append(round(io["busy_s"] / step, 2))
        for phase in ("fwd_bwd", "optimizer"):
            frac = io[f"{phase}.busy_s"] / max(io[f"{phase}.s"], 1e-9)
            out[f"{phase}_busy_fraction_per_rank"].append(round(frac, 2))
        out["direct_gb"] += (io.get("read_direct", 0) + io.get("write_direct", 0)) / 1e9
        out["buffered_gb"] += (io.get("read_buffered", 0) + io.get("write_buffered", 0)) / 1e9
    out["buffered_why"] = ranks[0].get("buffered_why", {})
    return out


def run(args) -> dict:
    from meshspeed import comm
    from meshspeed.offload import close
    from meshspeed.offload.aio import buffered_bytes, io_totals

    torch.set_num_threads(args.threads)
    nvme = [tempfile.mkdtemp(prefix="infinity-", dir=p) for p in args.nvme_path.split(",")]
    nvme = nvme[0] if len(nvme) == 1 else nvme  # a list: one directory per rank (Note [one disk per rank])
    cfg = gpt_config(args.params, args.vocab, args.seq, args.d_model)
    gc.collect()
    rss_start = rss_bytes()
    out: dict = {"config": vars(cfg).copy(), "rss_start": rss_start}
    with RssSampler(args.sample_ms / 1000) as sampler:
        model, engine = _build(args, cfg, sampler, nvme)
        rank = comm.get_rank()
        out["settings"] = chosen_settings(engine)
        out["params"] = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters())
        x, y = _batch(args, cfg, rank)
        losses, times, io, cpu = [], [], [], []
        counted = None  # io_totals() when step 1 starts (Note [bytes per step with updates in the forward])
        for i in range(args.steps):
            if i == 1:
                counted = io_totals()
            why_before = buffered_bytes()
            loss, dt, moved = _step(engine, x, y, sampler, f"step{i}")
            why = buffered_bytes()  # the last step's: which bytes went through the page cache
            out["buffered_why"] = {k: n - why_before.get(k, 0) for k, n in why.items()
                                   if n != why_before.get(k, 0)}
            losses.append(loss)
            times.append(dt)
            cpu.append(moved.pop("cpu"))
            io.append(moved)
            if rank == 0:
                print(f"step {i}: loss {loss:.4f} {dt:.1f} s rss {rss_bytes() / 2**30:.2f} GiB "
                      f"read {moved['read'] / 1e9:.1f} GB written {moved['write'] / 1e9:.1f} GB",
                      file=sys.stderr, flush=True)
        if counted is not None:  # the last step's updates left to a next forward, then counted
            engine.optimizer.settle()
            now = io_totals()
            out["io_steady"] = {k: (now[k] - counted[k]) / (args.steps - 1) for k in now}
        sampler.phase("after")
        mem = engine.memory_breakdown()
        out["swap_bytes"] = swap_bytes(nvme)
        if args.checkpoint_dir:
            saved = _save_and_continue(args, engine, x, y, sampler)
        close(engine)
        del model, engine  # gone before a resumed engine is built
        gc.collect()
        if args.checkpoint_dir:
            out["checkpoint"] = {**saved, **_resume(args, cfg, x, y, sampler)}
            out["checkpoint"]["equal"] = out["checkpoint"]["loss_continued"] == out["checkpoint"]["loss_resumed"]
    out.update(losses=losses, step_s=times, io_bytes=io, cpu_s=cpu, hwm=hwm_bytes(), sampled_peak=sampler.peak,
               phase_peaks=sampler.peaks, phase_seconds=sampler.seconds, memory_breakdown=mem)
    # the training peak: the largest phase other than build/initialize
    out["train_peak"] = max(v for k, v in sampler.peaks.items() if "build" not in k and "initialize" not in k)
    out["host_bytes_per_param"] = (out["hwm"] - rss_start) / out["params"]
    for d in [nvme] if isinstance(nvme, str) else nvme:
        shutil.rmtree(d, ignore_errors=True)
    return out


def _save_and_continue(args, engine, x, y, sampler) -> dict:
    """Save after the last step, then take one more step (what the resumed run must match)."""
    t = time.perf_counter()
    sampler.phase("save")
    engine.save_checkpoint(args.checkpoint_dir, tag="infinity")
    save_s = time.perf_counter() - t
    ckpt_bytes = swap_bytes(os.path.join(args.checkpoint_dir, "infinity"))
    continued, _, _ = _step(engine, x, y, sampler, "continued")
    return {"save_s": save_s, "bytes": ckpt_bytes, "loss_continued": continued}


def _resume(args, cfg, x, y, sampler) -> dict:
    """A fresh engine (its NVMe state rebuilt from the checkpoint) loads it and takes the
    step the saved run took after saving."""
    from meshspeed.offload import close

    resumed_dir = tempfile.mkdtemp(prefix="infinity-resumed-", dir=args.nvme_path.split(",")[0])
    sampler.phase("resume.build")
    _, fresh = _build(args, cfg, sampler, resumed_dir, phase="resume.")
    t = time.perf_counter()
    sampler.phase("resume.load")
    fresh.load_checkpoint(args.checkpoint_dir, tag="infinity")
    load_s = time.perf_counter() - t
    resumed, _, _ = _step(fresh, x, y, sampler, "resumed")
    close(fresh)
    shutil.rmtree(resumed_dir, ignore_errors=True)
    return {"load_s": load_s, "loss_resumed": resumed}


def matmul_peak_flops(threads: int, n: int = 2048, repeats: int = 5) -> float:
    """Best bf16 matmul FLOP/s of this process's threads (the compute bound's denominator)."""
    torch.set_num_threads(threads)
    a = torch.randn(n, n, dtype=torch.bfloat16)
    b = torch.randn(n, n, dtype=torch.bfloat16)
    a @ b
    best = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        best = max(best, 2 * n**3 / (time.perf_counter() - t))
    return best


def disk_bandwidth(path: str, args) -> tuple[float, float]:
    """(write, read) bytes/s of the swap engine on `path` with this run's aio settings:
    what `meshspeed aio-bench --path PATH --thread-count T` reports for its best request size."""
    from meshspeed.offload.aio import SwapEngine, io_totals
    from meshspeed.offload.aio_bench import _engine
    from meshspeed.offload.hostmem import ALIGN, host_empty

    work = tempfile.mkdtemp(prefix="infinity-bw-", dir=path)
    try:
        buf = host_empty((1 << 30) // 4, align=ALIGN).fill_(1.0)
        engine = SwapEngine(thread_count=args.aio_threads, queue_depth=8)
        before = io_totals()
        w, r = max(_engine(engine, buf, work, 64) for _ in range(2))
        after = io_totals()
        engine.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    buffered = sum(after[k] - before[k] for k in ("read_buffered", "write_buffered"))
    if buffered:  # the bound must be the disk's, not the page cache's
        print(f"warning: {buffered} bytes of the bandwidth measurement on {path} went through "
              "the page cache (the file system refused O_DIRECT): the I/O bound is optimistic",
              file=sys.stderr)
    return w * 1e9, r * 1e9


def _worker(rank: int, args, results: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(args.world),
                      LOCAL_WORLD_SIZE=str(args.world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(args.port))
    import meshspeed

    meshspeed.init_distributed(dist_backend="gloo")
    out = run(args)
    with open(os.path.join(results, f"rank{rank}.json"), "w") as f:
        json.dump(out, f, default=str)


def add_run_arguments(ap: argparse.ArgumentParser) -> None:
    """The model, batch and ZeRO-Infinity config arguments (shared with infinity_frameworks.py)."""
    ap.add_argument("--params", type=float, default=0.1e9)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--nvme-path", default=tempfile.gettempdir(),
                    help="the swap directories go under here (infinity.py: A,B = one per rank, rank r on path r %% 2)")
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--sub-group-size", type=int, default=50_000_000)
    ap.add_argument("--buffer-count", type=int, default=4)
    ap.add_argument("--param-buffer-count", type=int, default=5)
    ap.add_argument("--param-buffer-size", type=int, default=100_000_000)
    ap.add_argument("--prefetch", type=int, default=50_000_000)
    ap.add_argument("--max-live", type=int, default=1_000_000_000)
    ap.add_argument("--param-in-cpu", type=float, default=None, help="offload_param.max_in_cpu (unset: from MemAvailable)")
    ap.add_argument("--optimizer-in-cpu", type=float, default=None, help="offload_optimizer.max_in_cpu")
    ap.add_argument("--no-update-in-backward", dest="update_in_backward", action="store_false",
                    help="offload_optimizer.update_in_backward: false (the update waits for step())")
    ap.add_argument("--update-into-forward", action=argparse.BooleanOptionalAction, default=None,
                    help="offload_optimizer.update_into_forward: true (step() leaves the updates not "
                         "done yet to the next forward) or false (step() waits); unset: the default, true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--aio-threads", type=int, default=2, help="aio.thread_count")
    ap.add_argument("--sample-ms", type=float, default=20)
    ap.add_argument("--tutorial-config", action="store_true",
                    help="DeepSpeed's ZeRO-Infinity tutorial config: the buffer settings above are "
                         "ignored and initialize chooses them")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(ap)
    ap.add_argument("--d-model", type=int, default=None, help="width (default: by --params)")
    ap.add_argument("--world", type=int, default=1, help="processes (gloo), each one data-parallel rank")
    ap.add_argument("--port", type=int, default=29533)
    ap.add_argument("--checkpoint-dir", default=None, help="save after the steps, resume in a fresh engine")
    ap.add_argument("--markdown", action="store_true", help="print a markdown summary line")
    ap.add_argument("--write-docs", action="store_true",
                    help="replace this world size's row of the 2B table in docs/benchmarks.md (benchmarks/infinity_docs.py)")
    ap.add_argument("--render", metavar="JSON", default=None,
                    help="run nothing: write the row of an earlier run's benchmarks/results/infinity-2b-w<W>.json")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO / "benchmarks"))
    import docs_stamp  # lazy: benchmarks/ joins sys.path above
    import infinity_docs  # lazy: benchmarks/ joins sys.path above

    if args.render:
        infinity_docs.write(json.loads(Path(args.render).read_text()))
        return
    commit = docs_stamp.require_committed() if args.write_docs else docs_stamp.begin()
    flops = matmul_peak_flops(args.threads)
    bw_write, bw_read = disk_bandwidth(args.nvme_path.split(",")[0], args)
    results = tempfile.mkdtemp(prefix="infinity-results-")
    import torch.multiprocessing as mp

    mp.start_processes(_worker, args=(args, results), nprocs=args.world, start_method="spawn")
    ranks = []
    for r in range(args.world):
        with open(os.path.join(results, f"rank{r}.json")) as f:
            ranks.append(json.load(f))
    shutil.rmtree(results, ignore_errors=True)
    out = ranks[0]
    gib = 2**30
    tokens = args.micro * args.seq * args.world
    # the disk and the cores are shared by every rank: the step's I/O bound is all ranks'
    # bytes over one disk's O_DIRECT bandwidth (disk_bandwidth: aligned requests, direct), its compute bound 6 * params * all ranks' tokens over
    # the machine's bf16 matmul peak (measured with --threads threads: every core here)
    per_step = [steady(r) for r in ranks]
    busy = [io["busy_s"] / t for io, t in per_step]  # disk had work
    reads = sum(io["read"] for io, _ in per_step)
    writes = sum(io["write"] for io, _ in per_step)
    io_bound = reads / bw_read + writes / bw_write
    compute_bound = 6 * out["params"] * tokens / flops
    step = sorted(out["step_s"][1:] or out["step_s"])[len(out["step_s"][1:] or out["step_s"]) // 2]
    summary = {
        "params": out["params"], "world": args.world, "losses": out["losses"],
        "peak_rss_per_rank_gib": [round(r["hwm"] / gib, 2) for r in ranks],
        "train_peak_rss_per_rank_gib": [round(r["train_peak"] / gib, 2) for r in ranks],
        "phase_seconds": {k: round(v, 1) for k, v in out["phase_seconds"].items()},
        "swap_gib_per_rank": [round(r["swap_bytes"] / gib, 2) for r in ranks],
        "step_s": out["step_s"], "median_step_s": step,
        "io_gb_per_step": {"read": reads / 1e9, "write": writes / 1e9},
        "io_gb_per_step_per_rank": [{k: round(io[k] / 1e9, 3) for k in ("read", "write")}
                                    for io, _ in per_step],  # with --nvme-path A,B: rank r's on path r
        "disk_busy_fraction_per_rank": [round(b, 2) for b in busy],
        "disk": disk_report(ranks),
        "cpu": cpu_report(ranks, os.cpu_count() or 1),
        "disk_gbs": {"read": bw_read / 1e9, "write": bw_write / 1e9},
        "matmul_tflops": flops / 1e12, "io_bound_s": io_bound, "compute_bound_s": compute_bound,
        "step_over_bound": step / max(io_bound, compute_bound),
        "checkpoint": out.get("checkpoint"), "phase_peaks_gib": {k: round(v / gib, 2) for k, v in out["phase_peaks"].items()},
        "memory_breakdown_gib": {k: round(v / gib, 2) for k, v in out["memory_breakdown"].items() if isinstance(v, int)},
        "tiers_gib": {k: round(v / gib, 2) for k, v in out["memory_breakdown"]["tiers"].items()},
        "settings": out["settings"],
    }
    summary["commit"] = commit
    summary["command"] = " ".join(["PYTHONPATH=. .venv/bin/python benchmarks/infinity.py", *sys.argv[1:]])
    for k, v in summary.items():
        print(f"  {k}: {v}", file=sys.stderr)
    if args.markdown:
        c = summary["checkpoint"]
        print(f"| {out['params'] / 1e9:.2f}B | {args.world} | {max(summary['peak_rss_per_rank_gib']):.2f} | "
              f"{' -> '.join(f'{x:.3f}' for x in out['losses'])} | {step:.1f} | "
              f"{io_bound:.1f} ({(reads + writes) / 1e9:.0f} GB) | {compute_bound:.1f} | "
              f"{summary['step_over_bound']:.2f} | "
              f"{'saved, resumed: equal' if c and c['equal'] else ('not equal' if c else 'not run')} |")
    print(json.dumps(summary, default=str))
    if args.write_docs:
        infinity_docs.write(summary)
        print(f"wrote the world-{args.world} row of docs/benchmarks.md's 2B table", file=sys.stderr)


if __name__ == "__main__":
    main()
