"""Pipeline schedules as executed: bubble, activation memory per stage, and step time beside
DeepSpeed 0.19.8's PipelineEngine.

    .venv/bin/python benchmarks/pipeline.py --warmup 2 --steps 3 --repeats 3 --json \\
        --timeline-dir benchmarks/results/pipeline-timelines --write-docs   # about 9 minutes on 2 cores
    .venv/bin/python benchmarks/pipeline.py --profile     # the findings: split cost, message latency
    .venv/bin/python benchmarks/pipeline.py --render benchmarks/results/pipeline.json --write-docs

For each schedule (gpipe, 1f1b, interleaved with v = 2 chunks per stage, zb-h1), each number
of stages p in `--stages` (2 and 4) and each number of micro-batches m in `--micro-batches`
(4, 8, 16), meshspeed trains the GPT of `pipeline_worker.py` (8 blocks of d_model 256, 4
sequences of 64 tokens a micro-batch, fp32, AdamW, ZeRO 0) on p gloo ranks of this machine,
one intra-op thread each: `--warmup` untimed batches, `--steps` timed batches (each started at
a barrier, the slowest rank's time counted), then one more batch with the saved-tensor hooks
of Note [activation memory, measured] on. DeepSpeed's PipelineEngine (1F1B, its only
schedule) trains the same layers on the same data with the same config, in its own venv
(Note [DeepSpeed in its own venv] in zero.py), at the p of `--deepspeed-stages` (2).

Note [p = 4 on two cores]
Four ranks on a 2-core machine are oversubscribed: when all four stages have work, each
runs at about half speed and a span lasts longer than its compute; when two wait, the other
two run at full speed. The bubble measured there is a bubble of wall-clock time under time
sharing, not of compute, and step times at p = 4 measure the scheduler as much as the
pipeline. So p = 4 gives the bubble and memory figures (memory does not depend on speed),
and step times, against DeepSpeed too, are taken at p = 2 only, where each rank has a core.

Note [bubble, measured]
From `engine.gather_timeline()` of each timed batch (every stage's spans, Note [what a span
measures] in parallel/pipeline/runtime.py: a span starts once its inputs are there and ends
once its outputs are handed to isend), `timeline.bubble_fraction` = 1 - busy / (p x
(last end - first start)); the table shows the median over the timed batches. Beside it:
the formula, (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v m+p-1) interleaved, and
(p-1)/(3m+p-1) for ZB-H1 (its paper's figure for t_F = t_I = t_W); and `schedule.simulate`
of the same lists with the median measured t_F, t_B (or t_I and t_W), which is the formula's
assumption of uniform stages and free communication, but with this run's own ratios of the
pass times (ZB-H1's bubble depends on them, the others' do not).

Note [activation memory, measured]
"Activation memory" here is the bytes of tensors saved for backward that are alive at once,
per stage, over one batch. A `torch.autograd.graph.saved_tensors_hooks` pack hook wraps every
tensor autograd saves in a handle; a storage is counted (its whole `nbytes`, once however
many saved tensors view it) from the first handle to the last handle's release, which is
when autograd frees the node after its backward. Parameters are not activations: storages
of this stage's parameters are never counted (a Linear saves its weight for the input
gradient). ZB-H1's input half leaves each Linear's (x, dy) queued for the weight half
outside autograd (parallel/pipeline/weight_grad.py); the benchmark wraps
`DeferredWeights.add`/`apply` so those storages stay counted until their W has run (this
instruments, it does not change what runs). Not counted: the stage's output kept as the
root of its backward and its send buffer (one (B, T, d) tensor a micro-batch, 0.25 MiB
here, against about 4 MiB saved per block and micro-batch). "One micro-batch's worth" is the
bytes that became counted during the F spans of this batch, divided by m (on an
interleaved stage: both chunks' forwards of one micro-batch), so `peak / worth` is the
number of micro-batches in flight the memory corresponds to. The bound is
`schedule.simulate`'s peak in flight: p - s on stage s for 1F1B, m for GPipe, p for ZB-H1,
and for interleaved (p-s-1)*2 + (v-1)*p + 1 chunk forwards, shown as micro-batches (/ v).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))  # siblings, also in spawned ranks

from pipeline_worker import (
    LoadMeter,
    ModelConfig,
    _free_port,
    engine_config,
    layer_specs,
    lm_loss,
    make_batches,
    timed_batches,
    wait_until_idle,
)

REPO = Path(__file__).resolve().parent.parent
ANCHOR_PY = Path("/root/.cache/meshspeed-anchors/bin/python")
SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb-h1"]
VIRTUAL = {"interleaved": 2}
MIB = 2**20


# -- activation memory (Note [activation memory, measured]) -----------------------------------------


class SavedBytes:
    """Bytes of storages that saved-for-backward tensors hold, alive at once."""

    def __init__(self, exclude: set[int]):
        self.exclude = exclude  # data_ptrs of the stage's parameter storages
        self.count: dict[int, list[int]] = {}  # storage data_ptr -> [handles, nbytes]
        self.live = self.peak = 0
        self.added: list[tuple[float, int]] = []  # (perf_counter, bytes) when a storage starts counting

    def acquire(self, t: torch.Tensor) -> int | None:
        s = t.untyped_storage()
        key = s.data_ptr()
        if key in self.exclude or s.nbytes() == 0:
            return None
        entry = self.count.get(key)
        if entry is None:
            self.count[key] = [1, s.nbytes()]
            self.live += s.nbytes()
            self.peak = max(self.peak, self.live)
            self.added.append((time.perf_counter(), s.nbytes()))
        else:
            entry[0] += 1
        return key

    def release(self, key: int | None) -> None:
        if key is None:
            return
        entry = self.count[key]
        entry[0] -= 1
        if entry[0] == 0:
            del self.count[key]
            self.live -= entry[1]


class _Handle:
    __slots__ = ("key", "tensor", "tracker")

    def __init__(self, tracker: SavedBytes, tensor: torch.Tensor):
        self.tracker, self.tensor, self.key = tracker, tensor, tracker.acquire(tensor)

    def __del__(self):
        self.tracker.release(self.key)


class track_saved:
    """Count saved-for-backward storages while inside (and ZB-H1's queued (x, dy))."""

    def __init__(self, module: torch.nn.Module):
        self.tracker = SavedBytes({p.untyped_storage().data_ptr() for p in module.parameters()})

    def __enter__(self) -> SavedBytes:
        from meshspeed.parallel.pipeline import weight_grad

        tracker, cls = self.tracker, weight_grad.DeferredWeights
        self._orig = cls.add, cls.apply

        def add(deferred, slot, x, dy):
            deferred.__dict__.setdefault("_bench_handles", []).extend((_Handle(tracker, x), _Handle(tracker, dy)))
            return self._orig[0](deferred, slot, x, dy)

        def apply(deferred):
            try:
                return self._orig[1](deferred)
            finally:
                deferred.__dict__.pop("_bench_handles", None)

        cls.add, cls.apply = add, apply
        self._hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: _Handle(tracker, t), lambda h: h.tensor)
        self._hooks.__enter__()
        return tracker

    def __exit__(self, *exc):
        from meshspeed.parallel.pipeline import weight_grad

        self._hooks.__exit__(*exc)
        weight_grad.DeferredWeights.add, weight_grad.DeferredWeights.apply = self._orig
        return False


# -- one configuration on the ranks ------------------------------------------------------------------


def _kind_times(spans) -> dict[str, float]:
    """Median span length of each kind over every stage (seconds)."""
    out = {}
    for kind in "FBIW":
        ts = [s.end - s.start for row in spans for s in row if s.kind == kind]
        if ts:
            out[kind] = statistics.median(ts)
    return out


def run_config(schedule: str, m: int, cfg: ModelConfig, warmup: int, steps: int, wait_idle: float) -> dict:
    """One schedule at one m on every rank; returns this rank's numbers (timelines only on
    the rank that gathers them, which every rank does)."""
    import meshspeed
    from meshspeed.parallel.pipeline.timeline import bubble_fraction, to_json
    from meshspeed.pipe import LayerSpec, PipelineModule

    p = dist.get_world_size()
    v = VIRTUAL.get(schedule, 1)
    torch.manual_seed(cfg.seed)
    net = PipelineModule(layers=layer_specs(cfg, LayerSpec), num_stages=p, loss_fn=lm_loss,
                         partition_method="type:Block", virtual_stages=v)
    config = {**engine_config(cfg, m), "pipeline": {"schedule": schedule}}
    engine, *_ = meshspeed.initialize(model=net, model_parameters=net.parameters(), config=config)
    batches = make_batches(cfg, warmup + steps + 1, m)
    timed_batches(engine, batches[:warmup], dist.barrier)
    engine.record_timeline = True
    seconds, cpu, losses, timelines = [], [], [], []
    if dist.get_rank() == 0 and wait_idle:
        wait_until_idle(wait_idle)
    meter = LoadMeter()
    meter.start()
    for batch in batches[warmup:warmup + steps]:
        s, c, loss = timed_batches(engine, [batch], dist.barrier)
        seconds += s
        cpu += c
        losses += loss
        timelines.append(engine.gather_timeline())  # a collective, outside the timed batch
    load = meter.stop(dist.all_gather_object)
    bubbles = [bubble_fraction(t) for t in timelines]
    median_batch = sorted(range(steps), key=lambda i: bubbles[i])[steps // 2]
    spans = timelines[median_batch]
    # the memory batch: saved tensors counted (Note [activation memory, measured])
    dist.barrier()
    with track_saved(engine.module) as tracker:
        engine.train_batch(iter(batches[-1]))
    mine = engine.gather_timeline()[engine.stage_id]
    in_forward = sum(b for t, b in tracker.added if any(s.kind == "F" and s.start <= t <= s.end for s in mine))
    memory = {"stage": engine.stage_id, "peak_bytes": tracker.peak, "micro_batch_bytes": in_forward / m,
              "left_counted": tracker.live}
    return {"schedule": schedule, "micro_batches": m, "stages": p, "virtual_stages": v,
            "step_s": seconds, "cpu_s": cpu, "losses": losses, "bubbles": bubbles, "other_load": load,
            "timeline": to_json(spans) if dist.get_rank() == 0 else None,
            "pass_s": _kind_times(spans), "memory": memory,
            "stage_params": sum(q.numel() for q in engine.module.parameters())}


def meshspeed_rank(rank: int, world: int, port: int, cfg: ModelConfig, schedules: list[str],
                   micro_batches: list[int], warmup: int, steps: int, wait_idle: float, out_file: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results = []
        for schedule in schedules:
            for m in micro_batches:
                if m % world and schedule == "interleaved":
                    continue
                t0 = time.time()
                r = run_config(schedule, m, cfg, warmup, steps, wait_idle)
                gathered = [None] * world
                dist.all_gather_object(gathered, r)
                if rank == 0:
                    results.append(gathered)
                    print(f"  meshspeed {schedule:11s} p={world} m={m:2d}: step {statistics.median(r['step_s']):.3f}s "
                          f"cpu {statistics.median(r['cpu_s']):.3f}s "
                          f"bubble {statistics.median(r['bubbles']):.3f} other load {r['other_load']:.0%}  "
                          f"[{time.time() - t0:.0f}s]", flush=True)
        if rank == 0:
            Path(out_file).write_text(json.dumps(results))
    finally:
        dist.barrier()
        dist.destroy_process_group()


def run_meshspeed(p: int, cfg: ModelConfig, schedules, micro_batches, warmup: int, steps: int,
                  wait_idle: float) -> list:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(meshspeed_rank, args=(p, _free_port(), cfg, schedules, micro_batches, warmup, steps, wait_idle, out),
                 nprocs=p, join=True)
        return json.loads(Path(out).read_text())


def run_deepspeed(python: str, p: int, cfg: ModelConfig, micro_batches, warmup: int, steps: int,
                  wait_idle: float) -> dict:
    """pipeline_worker.py's DeepSpeed entry in its own venv; its log is shown only on failure."""
    with tempfile.TemporaryDirectory() as tmp:
        out, log = Path(tmp) / "ds.json", Path(tmp) / "log"
        cmd = [python, str(Path(__file__).resolve().parent / "pipeline_worker.py"), "--stages", str(p),
               "--micro-batches", *map(str, micro_batches), "--warmup", str(warmup), "--steps", str(steps),
               "--wait-idle", str(wait_idle), "--config-json", json.dumps(asdict(cfg)), "--out", str(out)]
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing of meshspeed
        env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
        # DeepSpeed JIT-builds its CPU shared-memory comm op at init; in the shared default cache
        # other checkouts' DeepSpeed venvs make it rebuild (minutes on 2 cores), so ours has its own
        env.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "meshspeed-pipeline-bench-extensions"))
        with open(log, "w") as f:
            rc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=1800, check=False).returncode
        if not out.exists():
            tail = "\n".join(log.read_text(errors="replace").strip().splitlines()[-15:])
            raise RuntimeError(f"DeepSpeed's run (in {python}) exited {rc} without results; its log ends:\n{tail}")
        return json.loads(out.read_text())


# -- profiles (--profile) ------------------------------------------------------------------------------


def profile_split(cfg: ModelConfig, reps: int = 20) -> list[str]:
    """CPU time of one p = 2 stage (half the blocks) on one micro-batch: an ordinary forward
    and backward against ZB-H1's forward under the split capture, input half I and weight
    half W (parallel/pipeline/weight_grad.py), and torch.profiler's view of the difference."""
    from pipeline_worker import Block
    from torch.profiler import ProfilerActivity, profile

    from meshspeed.parallel.pipeline.weight_grad import DeferredWeights

    torch.set_num_threads(1)
    stage = torch.nn.Sequential(*[Block(cfg, i + 1) for i in range(cfg.n_layer // 2)])
    x0 = torch.randn(cfg.micro_batch, cfg.seq_len, cfg.d_model)
    dy = torch.randn_like(x0)
    clock = time.process_time

    def whole():
        x = x0.clone().requires_grad_()
        t0 = clock()
        y = stage(x)
        t1 = clock()
        y.backward(dy)
        return t1 - t0, clock() - t1, 0.0

    def split():
        x, deferred = x0.clone().requires_grad_(), DeferredWeights()
        t0 = clock()
        with deferred.capture():
            y = stage(x)
        t1 = clock()
        y.backward(dy)
        t2 = clock()
        deferred.apply()
        return t1 - t0, t2 - t1, clock() - t2

    for f in (whole, split, whole, split):
        f()
    got: dict = {"whole": [], "split": []}
    for _ in range(reps):  # alternating, so that other load hits both alike
        got["whole"].append(whole())
        got["split"].append(split())
    lines = [f"One p = 2 stage ({cfg.n_layer // 2} blocks), one micro-batch, CPU ms (median of {reps}, alternating):"]
    totals: dict = {}
    for name, runs in got.items():
        f, b, w = (1e3 * statistics.median(c) for c in zip(*runs))
        totals[name] = f + b + w
        lines.append(f"  {name:5s}: F {f:.1f}  {'B' if name == 'whole' else 'I'} {b:.1f}"
                     + (f"  W {w:.1f}" if name == "split" else "") + f"  total {f + b + w:.1f}")
    lines.append(f"  the split costs {totals['split'] / totals['whole'] - 1:+.1%} CPU")
    groups = {"GEMMs (aten::mm, addmm, bmm)": ("aten::mm", "aten::addmm", "aten::bmm"),
              "the split's Python autograd nodes": ("_SplitLinear", "_SplitLinearBackward", "_WeightGrad",
                                                    "_WeightGradBackward")}
    lines.append("  torch.profiler, self CPU ms per micro-batch (whole -> split):")
    profiled: dict = {}
    for f in (whole, split):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                f()
        events = {e.key: e.self_cpu_time_total / 5e3 for e in prof.key_averages()}
        total = sum(events.values())
        parts = {g: sum(events.get(k, 0.0) for k in keys) for g, keys in groups.items()}
        profiled[f.__name__] = (parts, total)
    for g in groups:
        lines.append(f"    {g:36s} {profiled['whole'][0][g]:6.1f} -> {profiled['split'][0][g]:6.1f}")
    rest = {n: t - sum(parts.values()) for n, (parts, t) in profiled.items()}
    lines.append(f"    {'everything else':36s} {rest['whole']:6.1f} -> {rest['split']:6.1f}")
    return lines


def _message_rank(rank: int, port: int, messages: int, reps: int, out_file: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    waits = []
    a = torch.randn(256, 256)
    for _ in range(reps):
        dist.barrier()
        if rank == 0:  # isend, then compute for 60 ms, as a stage does after handing on its output
            works = [dist.isend(torch.zeros(12, dtype=torch.int64), 1, tag=1)] if messages > 1 else []
            works.append(dist.isend(torch.randn(4, 64, 256), 1, tag=2))
            t = time.perf_counter()
            while time.perf_counter() - t < 0.06:
                a @ a
            for w in works:
                w.wait()
        else:  # receive while the sender computes
            time.sleep(0.02)
            t0 = time.perf_counter()
            if messages == 2:  # the way the runtime does: the header, then the data
                dist.recv(torch.empty(12, dtype=torch.int64), 0, tag=1)
            if messages == 3:  # both receives posted at once
                works = [dist.irecv(torch.empty(12, dtype=torch.int64), 0, tag=1),
                         dist.irecv(torch.empty(4, 64, 256), 0, tag=2)]
                for w in works:
                    w.wait()
            else:
                dist.recv(torch.empty(4, 64, 256), 0, tag=2)
            waits.append(time.perf_counter() - t0)
    if rank == 1:
        Path(out_file).write_text(json.dumps(statistics.median(waits)))
    dist.destroy_process_group()


def profile_messages(reps: int = 30) -> list[str]:
    """How long a receive takes when the data was isent 20 ms earlier and the sender is
    computing: gloo moves a message only once the receiver has posted its receive, so each
    message costs a wake-up of the sender's I/O thread, on a core its compute thread holds."""
    lines = ["Receiving one activation ((4, 64, 256) fp32) while the sender computes, gloo, 2 ranks (median ms):"]
    with tempfile.TemporaryDirectory() as tmp:
        for messages, what in ((1, "data only (DeepSpeed after its first batch)"),
                               (2, "96-byte header, then data (meshspeed, every micro-batch)"),
                               (3, "header and data, both receives posted at once")):
            out = os.path.join(tmp, f"{messages}.json")
            mp.spawn(_message_rank, args=(_free_port(), messages, reps, out), nprocs=2, join=True)
            lines.append(f"  {what}: {1e3 * json.loads(Path(out).read_text()):.2f} ms")
    return lines


from docs_stamp import require_committed
from pipeline_report import (
    bubble_table,
    markdown,
    memory_table,
    step_table,
    summarise,
    targets,
    write_docs,
)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--schedules", nargs="+", default=SCHEDULES, choices=SCHEDULES)
    ap.add_argument("--warmup", type=int, default=1, help="untimed batches per configuration")
    ap.add_argument("--steps", type=int, default=3, help="timed batches per configuration")
    ap.add_argument("--deepspeed-stages", type=int, default=2, help="p of the step-time comparison")
    ap.add_argument("--repeats", type=int, default=1,
                    help="run the step-time comparison (meshspeed and DeepSpeed at --deepspeed-stages) this many "
                         "times in turn; each configuration's fastest run is reported")
    ap.add_argument("--wait-idle", type=float, default=15.0, metavar="SECONDS",
                    help="before timing each configuration at --deepspeed-stages, wait up to this long for the "
                         "machine to be <20%% busy")
    ap.add_argument("--deepspeed-python", default=str(ANCHOR_PY),
                    help="interpreter with DeepSpeed 0.19.8 ('' skips DeepSpeed)")
    ap.add_argument("--json", nargs="?", const=str(REPO / "benchmarks" / "results" / "pipeline.json"),
                    default=None, metavar="PATH", help="write the results (default path benchmarks/results/pipeline.json)")
    ap.add_argument("--timeline-dir", default=None, help="write each configuration's timeline "
                    "(to_json(gather_timeline())) as SCHEDULE-pP-mM.json here, for `meshspeed pipeline-plot`")
    ap.add_argument("--findings", default=str(REPO / "benchmarks" / "pipeline_findings.md"),
                    help="markdown appended to the docs section (the profile's findings)")
    ap.add_argument("--profile", action="store_true",
                    help="only profile: the CPU cost of ZB-H1's split backward on one stage, and the latency "
                         "of one message against a header and a message while the sender computes")
    ap.add_argument("--render", metavar="JSON", default=None,
                    help="run nothing: rebuild the docs section from a --json file of an earlier run")
    ap.add_argument("--markdown", action="store_true", help="print the docs section")
    ap.add_argument("--write-docs", action="store_true", help="replace the section in docs/benchmarks.md")
    args = ap.parse_args(argv)
    if args.write_docs and not args.render:
        require_committed()  # refuse uncommitted code before the run, not after it
    cfg = ModelConfig()
    if args.profile:
        print("\n".join(profile_split(cfg) + profile_messages()))
        return
    if args.render:
        saved = json.loads(Path(args.render).read_text())
        for key, value in saved["args"].items():
            setattr(args, key, value)
        section = markdown(saved["meshspeed"], saved["deepspeed"], ModelConfig(**saved["config"]), args,
                           saved["command"], saved["machine"])
        print(section)
        if args.write_docs:
            write_docs(section, REPO / "docs" / "benchmarks.md", measured=saved["machine"]["meshspeed commit"])
            print("wrote docs/benchmarks.md (pipeline.py section)")
        return
    t_start = time.time()
    ds_ok = bool(args.deepspeed_python) and Path(args.deepspeed_python).exists()
    args.deepspeed_skipped = "" if ds_ok else (f"no interpreter at {args.deepspeed_python!r} (build it with "
                                              "../shared/tools/anchor-venv.sh)")
    best: dict[tuple, dict] = {}  # (schedule, p, m) -> the fastest run's row
    ds_runs: list[dict] = []
    timed_p = args.deepspeed_stages
    order = [p for p in args.stages if p == timed_p] * args.repeats + [p for p in args.stages if p != timed_p]
    for i, p in enumerate(order):
        print(f"meshspeed, p={p} ({p} ranks)", flush=True)
        wait = args.wait_idle if p == timed_p else 0.0  # only step times need a quiet machine
        for r in run_meshspeed(p, cfg, args.schedules, args.micro_batches, args.warmup, args.steps, wait):
            row = summarise(r)
            key = (row["schedule"], p, row["micro_batches"])
            runs = best.get(key, {}).get("all_runs", []) + [{k: row[k] for k in ("median_step_s", "other_load")}]
            if key not in best or row["median_step_s"] < best[key]["median_step_s"]:
                best[key] = row
            best[key]["all_runs"] = runs
        if p == timed_p and ds_ok:
            print(f"DeepSpeed, p={p}", flush=True)
            try:
                ds_runs.append(run_deepspeed(args.deepspeed_python, p, cfg, args.micro_batches, args.warmup,
                                             args.steps, args.wait_idle))
                for r in ds_runs[-1]["results"]:
                    print(f"  deepspeed 1f1b        p={p} m={r['micro_batches']:2d}: step {r['median_step_s']:.3f}s "
                          f"cpu {r['median_cpu_s']:.3f}s other load {r['other_load']:.0%}", flush=True)
            except (RuntimeError, subprocess.TimeoutExpired) as err:
                args.deepspeed_skipped = str(err)
                print(f"DeepSpeed failed: {err}", flush=True)
    rows = [best[k] for k in sorted(best, key=lambda k: (k[1], k[2], SCHEDULES.index(k[0])))]
    ds = None
    if ds_runs:  # each m's fastest run
        ds = dict(ds_runs[0])
        ds["results"] = []
        for m in args.micro_batches:
            tries = [r for run in ds_runs for r in run["results"] if r["micro_batches"] == m]
            if tries:
                pick = dict(min(tries, key=lambda r: r["median_step_s"]))
                pick["all_runs"] = [{k: r[k] for k in ("median_step_s", "other_load")} for r in tries]
                ds["results"].append(pick)
    print(f"done in {time.time() - t_start:.0f}s", flush=True)
    from zero_report import machine_description

    machine = machine_description()
    if ds:
        machine["deepspeed"] = f"{ds['deepspeed']} (its own venv, {args.deepspeed_python})"
    command = " ".join([".venv/bin/python", "benchmarks/pipeline.py", *(argv if argv is not None else sys.argv[1:])])
    if args.timeline_dir:
        out = Path(args.timeline_dir)
        out.mkdir(parents=True, exist_ok=True)
        for r in rows:
            (out / f"{r['schedule']}-p{r['stages']}-m{r['micro_batches']}.json").write_text(json.dumps(r["timeline"]))
    print("\n".join(bubble_table(rows)))
    print("\n".join(memory_table(rows)))
    print("\n".join(step_table(rows, ds, args.deepspeed_stages)))
    print("\n".join(targets(rows, ds, args.deepspeed_stages)))
    if args.json:
        keep = [{k: v for k, v in r.items() if k != "timeline"} for r in rows]
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        saved_args = {k: getattr(args, k) for k in ("warmup", "steps", "repeats", "deepspeed_stages",
                                                    "deepspeed_skipped", "deepspeed_python")}
        Path(args.json).write_text(json.dumps({"command": command, "machine": machine, "config": asdict(cfg),
                                               "args": saved_args, "meshspeed": keep, "deepspeed": ds}, indent=1))
        print(f"wrote {args.json}")
    section = markdown(rows, ds, cfg, args, command, machine)
    if args.markdown:
        print(section)
    if args.write_docs:
        write_docs(section, REPO / "docs" / "benchmarks.md")
        print("wrote docs/benchmarks.md (pipeline.py section)")


if __name__ == "__main__":
    main()
