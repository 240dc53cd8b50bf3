"""ZeRO stages 0-3 against torch DDP, torch FSDP2 and DeepSpeed 0.19.8.

One command trains the same GPT (same seed, same data, AdamW) with every framework on N gloo
ranks of this machine, one intra-op thread per rank, and writes step time, peak RSS and
model-state bytes per rank, as ratios against DDP, into one section of docs/benchmarks.md
and into benchmarks/results/zero-SHAPE-PRECISION-N.json. Each (shape, precision, N) run has
its own section (`<!-- zero.py:default-fp32-2:start -->` ... `:end -->`), so runs of
different shapes, precisions and world sizes coexist; rerunning one replaces only its own:

    .venv/bin/python benchmarks/zero.py --steps 30 --warmup 5
    .venv/bin/python benchmarks/zero.py --steps 30 --warmup 5 --frameworks all --max-runs 3
    .venv/bin/python benchmarks/zero.py --steps 30 --warmup 5 --bf16
    .venv/bin/python benchmarks/zero.py --steps 30 --warmup 5 --shape vocab-heavy
    .venv/bin/python benchmarks/zero.py --steps 30 --warmup 5 --shape layer-heavy --nproc 4

`--shape` picks a model preset (zero_frameworks.SHAPES: `default`, `vocab-heavy` where the
embedding and the head hold 91% of the parameters, `layer-heavy` with 16 thin blocks);
`--bf16` trains in bf16 with fp32 master weights, each framework in its natural bf16 mode
(Note [bf16 in each framework] in zero_frameworks.py). The first command takes about 4
minutes on an idle 2-core machine (9 frameworks, 15-30 s each, startup included); `--frameworks
all` adds the two persistence-threshold variants (meshspeed stage 3 at DeepSpeed's default
1e5, DeepSpeed stage 3 at meshspeed's default 0) and `--max-runs` reruns frameworks whose
timing was disturbed by other jobs (Note [paired ratios]
On the shared machines these run on, a framework's step time moves by 20% from one
minute to the next with no other process running (the CPU itself gets slower: CPU time
moves with wall time), more than the differences the targets are about. With `--repeats R`
the list runs round-robin R times, so one round's frameworks run within a few minutes of
each other; the targets then compare the median over rounds of each round's ratio (two
frameworks' times in the same round) rather than each framework's best run. The table
still shows each framework's fastest quiet run.

Note [timing on a shared machine]). `--nproc 4` on 2
cores about doubles the wall clock of every step.

`--profile FRAMEWORK` instead runs torch.profiler on rank 0 for a few steps of one
framework and prints the ops with the largest self CPU time.

Note [DeepSpeed in its own venv]
DeepSpeed is no dependency of meshspeed: it lives in a separate venv that
../shared/tools/anchor-venv.sh builds once and whose python it prints (torch 2.13 CPU,
DeepSpeed 0.19.8). The deepspeed-* rows run this script there (its hidden --worker-framework
entry, which runs `spawn` for that one framework and writes the ranks' JSON to a file), with
PYTHONPATH pointing at this checkout: the rank code imports only meshspeed's model, data and
byte counting, which need nothing beyond torch, numpy and pydantic. DeepSpeed gets its CPU
accelerator (DS_ACCELERATOR=cpu), the same gloo process group (`deepspeed.init_distributed(
dist_backend="gloo")`, before the RSS baseline like the other frameworks' process groups),
the same config as meshspeed with `"torch_adam": true` (torch's fused AdamW, no JIT-built
optimizer op) and `"gradient_clipping": 0` (its default is 1.0). Its comm layer JIT-builds a
shared-memory op (used only for inference all-reduce) on the very first run, 30-40 s, cached
in ~/.cache/torch_extensions afterwards. When the venv cannot be built or imported, the
DeepSpeed rows say "skipped: <why>".

Note [one spawn per framework]
A process's peak RSS never goes down, and glibc keeps freed heap pages, so frameworks that
share processes would inherit each other's peaks. Each framework therefore runs in fresh
rank processes, and each rank also resets its peak (`/proc/self/clear_refs`, "5") just
before it builds the model: `peak RSS` is the process's whole high-water mark,
`above baseline` the part above what the process held once torch, the process group, the
data and the framework's own modules (`_import_framework`) were loaded. Rank 0 gathers every rank's numbers and hands them to this (parent)
process, which writes the report (for DeepSpeed, through the worker process of Note
[DeepSpeed in its own venv], which only waits for its ranks meanwhile).

Note [what counts as model state]
Bytes of parameters (master weights included), gradients and optimizer state resident on a
rank, counted from the tensors themselves (each storage once,
`meshspeed.parallel.memory.count_bytes`), taken after the backward and before the optimizer
step of one extra, untimed step: the moment all three exist. meshspeed reports its own
(`engine.memory_breakdown()`; stage-3 gathered parameters are released by then). For DDP and
FSDP2 we count `p`, `p.grad` and the optimizer state, through `.to_local()` for FSDP2's
DTensors (plus the fp32 masters of the bf16 DDP baseline). DDP's reducer keeps its own flat
gradient buckets (another Ψ gradients' worth with the default
`gradient_as_bucket_view=False`); torch does not expose them, so they show in RSS only.
DeepSpeed's is counted from its ZeRO optimizer's buffers (`deepspeed_state_bytes` in
zero_frameworks.py). Communication buffers (meshspeed's reduction buffers, the bf16 DDP
baseline's fp32 reduced gradients, DeepSpeed stage 3's reduce bucket) are reported apart, not
in the model state.

Note [timing on a shared machine]
Wall clock is what issue 3's targets are stated in, but on a machine that other jobs share
it measures them too. So each step also records the CPU time of the rank's process (all its
threads), and rank 0 measures how much of the machine's CPU time other processes took
during the timed steps (`other load`, from /proc/stat minus our ranks' own CPU time).
A run is quiet when that share is at most `--quiet-load` (5%). `--wait-idle` waits for the
machine to go quiet before each run, `--repeats` runs the whole list round-robin several
times, `--max-runs` reruns a framework that has not had a quiet run yet, and the report
shows each framework's fastest quiet run (or says it had none). `--nice -10` raises the
ranks' priority, which helps only against jobs in the same scheduling group (on a machine
where other sessions run in their own cgroups it did not).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))  # siblings, also in spawned ranks

from zero_frameworks import (
    ALL,
    DEFAULT,
    SHAPES,
    Setup,
    build_model,
    is_deepspeed,
    make_batches,
    make_trainer,
)
from zero_report import REPO, machine_description, render_markdown, summarise, targets, write_docs

# -- machine load -------------------------------------------------------------------------------


def _busy_seconds() -> float:
    """CPU seconds all processes of the machine have been busy since boot."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq = fields[:7]
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def machine_busy(interval: float = 1.0) -> float:
    """Fraction of the machine's CPUs busy over the next `interval` seconds."""
    b0, t0 = _busy_seconds(), time.perf_counter()
    time.sleep(interval)
    return (_busy_seconds() - b0) / ((time.perf_counter() - t0) * os.cpu_count())


def wait_until_idle(max_wait: float, threshold: float = 0.2) -> float:
    """Sleep until less than `threshold` of the machine is busy, or `max_wait` seconds pass;
    returns the last busy fraction measured."""
    deadline = time.monotonic() + max_wait
    busy = machine_busy()
    while busy >= threshold and time.monotonic() < deadline:
        busy = machine_busy(2.0)
    return busy


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
    step_s: list[float] = field(default_factory=list)  # wall clock per timed step
    cpu_s: list[float] = field(default_factory=list)  # CPU time of this process per timed step
    losses: list[float] = field(default_factory=list)  # every step, warm-up included
    baseline_rss_kb: int = 0
    peak_rss_kb: int = 0
    state: dict[str, int] = field(default_factory=dict)
    peak_reset: bool = False
    peak_gathered_bytes: int = -1  # meshspeed stage 3: most full-parameter bytes resident at once
    loop_cpu_s: float = 0.0  # this process's CPU time over the timed steps
    other_load: float = 0.0  # rank 0: share of the machine other processes used meanwhile


def _timed_steps(trainer, batches, setup: Setup, res: RankResult) -> None:
    for i, (x, y) in enumerate(batches[: setup.warmup + setup.steps]):
        dist.barrier()  # start every step together; the barrier itself is not timed
        if i == setup.warmup:
            busy0, wall0, cpu0 = _busy_seconds(), time.perf_counter(), time.process_time()
        t0, c0 = time.perf_counter(), time.process_time()
        loss = trainer.forward(x, y)
        trainer.backward(loss)
        trainer.optimizer_step()
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
        res.losses.append(float(loss.detach()))
        if i >= setup.warmup:
            res.step_s.append(elapsed)
            res.cpu_s.append(cpu)
    res.loop_cpu_s = time.process_time() - cpu0
    ours = [0.0] * dist.get_world_size()
    dist.all_gather_object(ours, res.loop_cpu_s)
    wall = time.perf_counter() - wall0
    others = _busy_seconds() - busy0 - sum(ours)  # ranks on other hosts add 0 here: fine
    res.other_load = max(0.0, others / (wall * os.cpu_count()))


PHASES = ("## forward", "## backward", "## optimizer step")


def _profile_steps(trainer, batches, setup: Setup, steps: int) -> str | None:
    """Profile `steps` steps after the warm-up; rank 0 returns the report, others None.

    Each phase is a `record_function` range, so the table also says how long forward,
    backward and the optimizer step took, waits for collectives included (a blocking
    collective's wait is not inside its c10d:: op: it lands in the self time of whatever
    range issued it, e.g. a hook's AccumulateGrad or an autograd Function's backward)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    def step(x, y):
        with record_function(PHASES[0]):
            loss = trainer.forward(x, y)
        with record_function(PHASES[1]):
            trainer.backward(loss)
        with record_function(PHASES[2]):
            trainer.optimizer_step()

    for x, y in batches[: setup.warmup]:
        step(x, y)
    active = dist.get_rank() == 0
    dist.barrier()
    t0, c0, b0 = time.perf_counter(), time.process_time(), _busy_seconds()
    with profile(activities=[ProfilerActivity.CPU]) if active else _NoProfile() as prof:
        for x, y in batches[setup.warmup : setup.warmup + steps]:
            step(x, y)
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    ours = [0.0] * dist.get_world_size()
    dist.all_gather_object(ours, cpu)
    other = max(0.0, (_busy_seconds() - b0 - sum(ours)) / (elapsed * os.cpu_count()))
    if not active:
        return None
    events = prof.key_averages()
    phases = {e.key: e.cpu_time_total / 1e3 / steps for e in events if e.key in PHASES}
    lines = [(f"{steps} profiled steps on rank 0: {elapsed / steps:.3f} s wall, {cpu / steps:.3f} s "
              f"CPU per step; other processes used {other:.0%} of the machine meanwhile"),
             "per step: " + ", ".join(f"{k[3:]} {phases.get(k, 0):.1f} ms" for k in PHASES)]
    return "\n".join(lines) + "\n" + events.table(sort_by="self_cpu_time_total", row_limit=25,
                                                   max_name_column_width=60)


class _NoProfile:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _import_framework(name: str) -> None:
    """Import what the framework's trainer will import, so that its modules (meshspeed's
    config models, FSDP, DeepSpeed's engine) count in the baseline, not as model memory."""
    import importlib

    modules = {"ddp": ["torch.nn.parallel"], "fsdp2": ["torch.distributed.fsdp"]}.get(name)
    if modules is None:
        library = name.split("-")[0]
        modules = ["meshspeed.engine.build", "meshspeed.offload", "meshspeed.checkpoint"] \
            if library == "meshspeed" else ["deepspeed"]
    for module in modules:
        importlib.import_module(module)


def rank_main(rank: int, world: int, port: int, name: str, setup: Setup, out_file: str,
              profile_steps: int, nice: int) -> None:
    if nice:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, nice)  # threads started later inherit it
        except OSError as err:
            print(f"rank {rank}: cannot set nice {nice} ({err}); running at default priority")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    if is_deepspeed(name):  # its engine wants its own comm layer over the same gloo group
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        batches = make_batches(setup, world, rank, setup.warmup + max(setup.steps, profile_steps) + 1)
        _import_framework(name)  # code is not model memory: loaded before the baseline
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
        trainer.backward(trainer.forward(x, y))
        res.state = trainer.state_bytes()
        res.peak_gathered_bytes = getattr(trainer, "peak_gathered_bytes", lambda: -1)()
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


def spawn(name: str, setup: Setup, world: int, profile_steps: int = 0, nice: int = 0):
    """Run one framework in `world` fresh processes; returns what rank 0 wrote, or raises
    RuntimeError when no rank 0 result came back."""
    with tempfile.TemporaryDirectory() as tmp:
        out_file = os.path.join(tmp, "result")
        try:
            mp.spawn(rank_main, args=(world, _free_port(), name, setup, out_file, profile_steps, nice),
                     nprocs=world, join=True)
        except Exception as err:  # a rank died: keep its results if it got as far as writing them
            if not os.path.exists(out_file):
                raise RuntimeError(f"{name}: {err}") from err
            print(f"{name}: a rank failed after the results were written ({err}); keeping them")
        text = Path(out_file).read_text()
    return text if profile_steps else json.loads(text)


# -- DeepSpeed, in its own venv ----------------------------------------------------------------

ANCHOR_VENV_SCRIPT = REPO.parent / "shared" / "tools" / "anchor-venv.sh"
WORKER_TIMEOUT_S = 3600  # one framework's whole run, startup included


def run_logged(cmd: list[str], log: Path, timeout: float) -> int | str:
    """Run a worker command in the DeepSpeed venv's environment, its output to `log`;
    its return code, or "timeout"."""
    with open(log, "w") as log_file:
        try:
            return subprocess.run(cmd, env=_worker_env(), stdout=log_file, stderr=subprocess.STDOUT,
                                  timeout=timeout, check=False).returncode
        except subprocess.TimeoutExpired:
            return "timeout"


def _worker_env() -> dict[str, str]:
    """Environment of the DeepSpeed venv's processes: this checkout's meshspeed (the model and
    the data only) on the path, DeepSpeed's CPU accelerator, one OpenMP thread."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def find_deepspeed_python(explicit: str | None = None) -> tuple[str | None, str]:
    """(python, DeepSpeed version) of the venv the DeepSpeed rows run in, or (None, why not).

    The venv is built, once, by ../shared/tools/anchor-venv.sh, which prints its python;
    meshspeed is not installed there: its ranks import this checkout's through PYTHONPATH."""
    python = explicit
    if python is None:
        if not ANCHOR_VENV_SCRIPT.exists():
            return None, f"{ANCHOR_VENV_SCRIPT} not found (it builds the DeepSpeed venv)"
        try:
            r = subprocess.run(["bash", str(ANCHOR_VENV_SCRIPT)], capture_output=True, text=True,
                               timeout=WORKER_TIMEOUT_S, check=False)
        except (OSError, subprocess.TimeoutExpired) as err:
            return None, f"{ANCHOR_VENV_SCRIPT.name} failed: {err}"
        if r.returncode != 0 or not r.stdout.strip():
            return None, f"{ANCHOR_VENV_SCRIPT.name} failed: {_tail(r.stderr, 3) or r.returncode}"
        python = r.stdout.strip().splitlines()[-1]
    probe = ("import deepspeed, meshspeed.models.gpt, meshspeed.data.corpus, meshspeed.parallel.memory; "
             "print('deepspeed', deepspeed.__version__)")
    try:
        r = subprocess.run([python, "-c", probe], env=_worker_env(), capture_output=True, text=True,
                           timeout=600, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        return None, f"{python}: {err}"
    version = [line.split()[1] for line in r.stdout.splitlines() if line.startswith("deepspeed ")]
    if r.returncode != 0 or not version:
        return None, f"{python} cannot import deepspeed and meshspeed's model: {_tail(r.stderr, 1)}"
    return python, version[-1]


def spawn_in_venv(python: str, name: str, setup: Setup, world: int, profile_steps: int = 0,
                  nice: int = 0):
    """`spawn` run by another interpreter (this script's --worker-framework entry), whose
    output is kept in a log and shown only when no result comes back."""
    with tempfile.TemporaryDirectory() as tmp:
        out, log = Path(tmp) / "result.json", Path(tmp) / "log"
        cmd = [python, str(Path(__file__).resolve()), "--worker-framework", name,
               "--setup-json", json.dumps(asdict(setup)), "--worker-out", str(out),
               "--nproc", str(world), "--nice", str(nice)]
        if profile_steps:
            cmd += ["--profile", name, "--profile-steps", str(profile_steps)]
        rc = run_logged(cmd, log, WORKER_TIMEOUT_S)
        if not out.exists():
            raise RuntimeError(f"{name} (in {python}) exited {rc} without results; its log ends:\n"
                               + _tail(log.read_text(errors="replace")))
        return json.loads(out.read_text())


def run_framework(name: str, setup: Setup, world: int, profile_steps: int = 0, nice: int = 0,
                  deepspeed_python: str | None = None):
    if is_deepspeed(name):
        if deepspeed_python is None:
            raise RuntimeError(f"{name}: no python with DeepSpeed")
        return spawn_in_venv(deepspeed_python, name, setup, world, profile_steps, nice)
    return spawn(name, setup, world, profile_steps, nice)


# -- entry point --------------------------------------------------------------------------------


def _run_one(name: str, setup: Setup, args, tag: str) -> dict | None:
    t0 = time.time()
    try:
        r = summarise(name, run_framework(name, setup, args.nproc, nice=args.nice,
                                          deepspeed_python=args.deepspeed_python))
    except RuntimeError as err:
        print(f"[{tag}] {name:14s} FAILED: {err}", flush=True)
        return None
    state = r["model_state_bytes"]
    print(f"[{tag}] {name:14s} step {r['median_step_s']:.3f}s "
          f"cpu {r['median_cpu_s']:.3f}s other load {r['other_load']:.0%}  "
          f"peak RSS {r['peak_rss_mib']:.0f} MiB (+{r['peak_rss_delta_mib']:.0f})  "
          f"state {f'{state / 2**20:.2f} MiB' if state >= 0 else 'n/a'}  [{time.time() - t0:.0f}s]",
          flush=True)
    return r


def pick(results: list[dict], quiet_load: float) -> dict:
    """The fastest quiet run, or the fastest run when none was quiet; all runs kept."""
    quiet = [r for r in results if r["other_load"] <= quiet_load]
    best = dict(min(quiet or results, key=lambda r: r["median_step_s"]))
    best["quiet"] = bool(quiet)
    best["all_runs"] = [{k: r[k] for k in ("median_step_s", "median_cpu_s", "other_load")} for r in results]
    return best


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--frameworks", default=",".join(DEFAULT),
                    help=f"comma-separated, from {','.join(ALL)}, or 'all'; ddp always runs (the baseline)")
    ap.add_argument("--shape", default="default", choices=list(SHAPES),
                    help="model shape preset: " + "; ".join(
                        f"{k}: " + ", ".join(f"{f} {v}" for f, v in d.items()) for k, d in SHAPES.items()))
    ap.add_argument("--bf16", action="store_true",
                    help="bf16 compute with fp32 master weights (Note [bf16 in each framework] in "
                         "zero_frameworks.py)")
    ap.add_argument("--steps", type=int, default=30, help="timed steps")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps before timing")
    ap.add_argument("--nproc", type=int, default=2, help="ranks (processes)")
    ap.add_argument("--micro-batch", type=int, default=None, help="sequences per rank (default: the shape's)")
    ap.add_argument("--repeats", type=int, default=1, help="run the list this many times, keep the fastest")
    ap.add_argument("--quiet-load", type=float, default=0.05,
                    help="a run is quiet when other processes used at most this share of the machine")
    ap.add_argument("--max-runs", type=int, default=0,
                    help="rerun a framework that had no quiet run, up to this many runs in all")
    ap.add_argument("--wait-idle", type=float, default=60.0, metavar="SECONDS",
                    help="before each run, wait up to this long for the machine to be <20%% busy")
    ap.add_argument("--nice", type=int, default=0,
                    help="scheduling priority of the ranks; negative (needs privileges) shields the "
                         "timings from other jobs on a shared machine")
    ap.add_argument("--out", default=str(REPO / "docs" / "benchmarks.md"),
                    help="markdown report; its section for this shape, precision and nproc is replaced")
    ap.add_argument("--json", default=None,
                    help="results (default benchmarks/results/zero-SHAPE-PRECISION-NPROC.json)")
    ap.add_argument("--deepspeed-python", default=None, metavar="PYTHON",
                    help="interpreter with DeepSpeed for the deepspeed-* rows (default: the one "
                         "../shared/tools/anchor-venv.sh builds and prints)")
    ap.add_argument("--profile", metavar="FRAMEWORK", choices=ALL,
                    help="profile a few steps of one framework on rank 0 instead of benchmarking")
    ap.add_argument("--profile-steps", type=int, default=5)
    # the DeepSpeed venv's side of spawn_in_venv
    ap.add_argument("--worker-framework", help=argparse.SUPPRESS)
    ap.add_argument("--setup-json", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def worker_main(args) -> None:
    """Run one framework's ranks and write what `spawn` returns, as JSON, to --worker-out."""
    setup = Setup(**json.loads(args.setup_json))
    steps = args.profile_steps if args.profile else 0
    result = spawn(args.worker_framework, setup, args.nproc, profile_steps=steps, nice=args.nice)
    Path(args.worker_out).write_text(json.dumps(result))


def run_key(setup: Setup, world: int) -> str:
    """Names this run's docs section and results file: one per (shape, precision, nproc)."""
    return f"{setup.shape}-{setup.precision}-{world}"


def main(argv=None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.worker_framework:
        worker_main(args)
        return
    setup = Setup.of_shape(args.shape, micro_batch=args.micro_batch, warmup=args.warmup,
                           steps=args.steps, bf16=args.bf16)
    listed = [args.profile] if args.profile else ALL if args.frameworks == "all" else args.frameworks.split(",")
    wanted = ["ddp"] + [f for f in listed if f and f != "ddp"]
    unknown = [f for f in wanted if f not in ALL]
    if unknown:
        sys.exit(f"unknown framework(s) {unknown}; choose from {ALL}")
    skipped, ds_version = {}, None
    if any(is_deepspeed(f) for f in wanted):
        args.deepspeed_python, ds_version = find_deepspeed_python(args.deepspeed_python)
        if args.deepspeed_python is None:
            print(f"DeepSpeed rows skipped: {ds_version}", flush=True)
            skipped = {f: ds_version for f in wanted if is_deepspeed(f)}
            ds_version = None
    if args.profile:
        if args.profile in skipped:
            sys.exit(f"cannot profile {args.profile}: {skipped[args.profile]}")
        wait_until_idle(args.wait_idle)
        print(run_framework(args.profile, setup, args.nproc, profile_steps=args.profile_steps,
                            nice=args.nice, deepspeed_python=args.deepspeed_python))
        return
    runs: dict[str, list[dict]] = {f: [] for f in wanted if f not in skipped}
    for rep in range(args.repeats):
        for name, results in runs.items():
            wait_until_idle(args.wait_idle)
            if (r := _run_one(name, setup, args, f"{rep + 1}/{args.repeats}")) is not None:
                results.append(r)
    for name, results in runs.items():
        for attempt in range(args.repeats + 1, args.max_runs + 1):
            if any(r["other_load"] <= args.quiet_load for r in results):
                break
            wait_until_idle(args.wait_idle)
            if (r := _run_one(name, setup, args, f"retry {attempt}/{args.max_runs}")) is not None:
                results.append(r)
    failed = [name for name, rs in runs.items() if not rs]
    if "ddp" in failed:
        sys.exit("the DDP baseline failed in every run; nothing to compare against")
    skipped.update({name: "failed in every run (see the log)" for name in failed})
    rows = {name: pick(rs, args.quiet_load) for name, rs in runs.items() if rs}
    if args.repeats > 1 and all(len(rs) >= args.repeats for rs in runs.values()):
        for name, rs in runs.items():  # Note [paired ratios]: the rounds, in order
            rows[name]["rounds"] = [{k: r[k] for k in ("median_step_s", "median_cpu_s")} for r in rs[:args.repeats]]
    psi = build_model(setup).config.num_params()
    command = " ".join([".venv/bin/python", "benchmarks/zero.py", *(argv if argv is not None else sys.argv[1:])])
    machine = machine_description()
    if ds_version and any(is_deepspeed(n) for n in rows):
        machine["deepspeed"] = f"{ds_version} (its own venv, {args.deepspeed_python})"
    key = run_key(setup, args.nproc)
    json_path = Path(args.json) if args.json else REPO / "benchmarks" / "results" / f"zero-{key}.json"
    write_docs(render_markdown(rows, setup, args.nproc, psi, command, machine, skipped, args.quiet_load),
               Path(args.out), key)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps({
        "command": command, "machine": machine, "key": key, "setup": asdict(setup), "world": args.nproc,
        "psi": psi, "results": rows, "skipped": skipped,
        "targets_wall": targets(rows, psi, args.nproc),
        "targets_cpu": targets(rows, psi, args.nproc, key="median_cpu_s"),
    }, indent=1))
    print(f"wrote {args.out} (section {key}) and {json_path}")


if __name__ == "__main__":
    main()
