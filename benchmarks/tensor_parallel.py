"""Tensor parallelism side by side: torch's own TP, DeepSpeed 0.19 AutoTP and meshspeed, tp=2.

One command trains the same small randomly initialised `transformers` Llama (GQA, fp32) on
the same token batches with every implementation, each in its own pair of fresh gloo rank
processes (one intra-op thread each), and prints median step time, the ratio to the fastest
tp=2 run, the loss of the first and the last step, and for meshspeed the communication time
the training thread spent blocked (exposed) per step:

    .venv/bin/python benchmarks/tensor_parallel.py [--steps N] [--quick] [--markdown]
    .venv/bin/python benchmarks/tensor_parallel.py --repeats 3 --write-docs

The implementations (tp_frameworks.py): `single` (one process, no TP: the losses' ground
truth and what TP buys on this machine), torch `parallelize_module` with torchtitan's Llama
plan (plain TP; with sequence parallelism; with sequence and loss parallelism), DeepSpeed
AutoTP training (`"tensor_parallel": {"autotp_size": 2}`, ZeRO stage 0) in its own venv,
and meshspeed (`tensor_parallel` with `sequence_parallel` and `tp_overlap_comm`). A variant
that cannot run says "not available: <why>" in the table instead of failing the run.
`--markdown` prints the docs/benchmarks.md section; `--write-docs` also puts it there
(between `<!-- tensor_parallel.py:start -->` and `:end -->`) and writes
benchmarks/results/tensor-parallel.json.

Note [one init, one batch file]
The parent builds the model once from the seed and writes its state dict and all batches
to one file that every variant's ranks load, so each implementation starts from the same
weights and sees the same tokens even where its interpreter (DeepSpeed's venv) differs. The
first step's loss is then the same computation in every implementation, up to the order
of floating-point sums: the report checks each against `single` (within 1e-4).

Note [exposed communication]
Step time alone does not say whether an implementation hides its collectives behind
compute. meshspeed's comm layer times how long the training thread waits in its
collectives (`meshspeed.comm.BlockedTimer`: host time inside a synchronous collective or
the `wait()` of an asynchronous one, the autograd thread's included); the column is that time per step, the
larger of the two ranks' medians. torch's DTensor and DeepSpeed's comm have no such timer,
and anything measured from outside (e.g. a run with the collectives removed) would change
what is measured, so their column is empty.

Note [a link that does not take the CPU]
On this 2-core machine gloo moves bytes with the same cores that run the GEMMs: an async
all-reduce launched under a GEMM slows the GEMM by about what it takes (measured: a
786 KB all-reduce 2.3 ms, a 512x384x1024 GEMM 3.9 ms, both together 6.0 ms), so overlap
cannot hide communication here, only move where the waiting shows. GPUs move bytes with
copy engines and NICs, not with the SMs running the GEMM. `--slow-link MS_PER_MB` adds
that kind of link to meshspeed's runs (`meshspeed.testing.SlowLink`: every collective
also occupies one simulated link for 0.1 ms + MB x MS_PER_MB, in order, without using the
CPU), so the table shows what overlap hides when the link, not the CPU, is the limit. The
results are the same numbers (the tests check it); only the timing changes.

Timing follows zero.py (Note [timing on a shared machine] there): every step starts at an
untimed barrier; rank 0's wall clock is the step time; the CPU time of each rank and the
share of the machine other processes took meanwhile are recorded, and with `--repeats` the
fastest quiet run (other load at most `--quiet-load`) of each variant is shown.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))  # siblings, also in spawned ranks

from tp_frameworks import ALL, DEEPSPEED, REFERENCE, Setup, build_model, make_batches, make_trainer
from zero import (
    _busy_seconds,
    _free_port,
    _tail,
    find_deepspeed_python,
    run_logged,
    wait_until_idle,
)

REPO = Path(__file__).resolve().parent.parent
LOSS_TOL = 1e-4  # first-step loss against `single`
WORKER_TIMEOUT_S = 1200


# -- one rank -----------------------------------------------------------------------------------


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:300]


def _timed_steps(trainer, batches: torch.Tensor, setup: Setup) -> dict:
    res = {"step_s": [], "cpu_s": [], "blocked_s": [], "losses": []}
    for i, x in enumerate(batches[: setup.warmup + setup.steps]):
        dist.barrier()  # start every step together; the barrier is not timed
        if i == setup.warmup:
            busy0, wall0, loop_cpu0 = _busy_seconds(), time.perf_counter(), time.process_time()
        t0, c0 = time.perf_counter(), time.process_time()
        with trainer.blocked_timer() as blocked:
            loss = trainer.step(x)
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
        res["losses"].append(float(loss.detach()))
        if i >= setup.warmup:
            res["step_s"].append(elapsed)
            res["cpu_s"].append(cpu)
            if blocked.seconds is not None:
                res["blocked_s"].append(blocked.seconds)
    loop_cpu = time.process_time() - loop_cpu0
    ours = [0.0] * dist.get_world_size()
    dist.all_gather_object(ours, loop_cpu)
    others = _busy_seconds() - busy0 - sum(ours)
    res["other_load"] = max(0.0, others / ((time.perf_counter() - wall0) * os.cpu_count()))
    return res


def rank_main(rank: int, world: int, port: int, name: str, setup: Setup, inputs: str, out_file: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    if name in DEEPSPEED:  # its engine wants its own comm layer over the same gloo group
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo", verbose=False, timeout=timedelta(seconds=300))
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    try:
        data = torch.load(inputs)
        try:
            trainer = make_trainer(name, setup, world, data["state_dict"])
            res = _timed_steps(trainer, data["batches"], setup)
        except Exception as err:  # noqa: BLE001 - reported in the table, not raised
            res = {"unavailable": _first_line(err)}
        gathered = [None] * world
        dist.all_gather_object(gathered, res)
        if rank == 0:
            Path(out_file).write_text(json.dumps(gathered))
    finally:
        dist.destroy_process_group()


def spawn(name: str, setup: Setup, inputs: str) -> list[dict]:
    """One variant in fresh processes (world 1 for `single`, 2 otherwise): every rank's numbers."""
    world = 1 if name == REFERENCE else 2
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        try:
            mp.spawn(rank_main, args=(world, _free_port(), name, setup, inputs, str(out)), nprocs=world, join=True)
        except Exception as err:  # noqa: BLE001 - a rank died outside the guarded part
            if not out.exists():
                return [{"unavailable": f"a rank died: {_first_line(err)}"}]
            print(f"{name}: a rank failed after the results were written ({_first_line(err)}); keeping them",
                  flush=True)
        return json.loads(out.read_text())


def spawn_in_venv(python: str, name: str, setup: Setup, inputs: str) -> list[dict]:
    """`spawn` run by DeepSpeed's interpreter (this script's --worker entry)."""
    with tempfile.TemporaryDirectory() as tmp:
        out, log = Path(tmp) / "result.json", Path(tmp) / "log"
        cmd = [python, str(Path(__file__).resolve()), "--worker", name, "--setup-json",
               json.dumps(asdict(setup)), "--inputs", inputs, "--worker-out", str(out)]
        rc = run_logged(cmd, log, WORKER_TIMEOUT_S)
        if not out.exists():
            tail = _tail(log.read_text(errors="replace"), 1)
            return [{"unavailable": f"exited {rc} without results: {tail}"}]
        return json.loads(out.read_text())


# -- report -------------------------------------------------------------------------------------


def summarise(name: str, ranks: list[dict]) -> dict:
    if "unavailable" in ranks[0]:
        return {"name": name, "unavailable": ranks[0]["unavailable"]}
    r0 = ranks[0]
    blocked = [statistics.median(r["blocked_s"]) for r in ranks if r["blocked_s"]]
    return {
        "name": name,
        "step_ms": 1e3 * statistics.median(r0["step_s"]),
        "cpu_ms": 1e3 * max(statistics.median(r["cpu_s"]) for r in ranks),
        "exposed_comm_ms": 1e3 * max(blocked) if blocked else None,
        "other_load": r0["other_load"],
        "first_loss": r0["losses"][0],
        "last_loss": r0["losses"][-1],
        "losses": r0["losses"],
    }


def pick(runs: list[dict], quiet_load: float) -> dict:
    """The fastest quiet run of a variant, or its fastest run when none was quiet."""
    ok = [r for r in runs if "unavailable" not in r]
    if not ok:
        return runs[-1]
    quiet = [r for r in ok if r["other_load"] <= quiet_load]
    best = dict(min(quiet or ok, key=lambda r: r["step_ms"]))
    best.update(quiet=bool(quiet), runs=len(ok))
    return best


def table(rows: list[dict], setup: Setup) -> str:
    ran = [r for r in rows if "unavailable" not in r]
    peers = [r["step_ms"] for r in ran if r["name"] != REFERENCE]
    fastest = min(peers) if peers else None
    ref = next((r["first_loss"] for r in ran if r["name"] == REFERENCE), None)
    n = setup.warmup + setup.steps
    out = [(f"| implementation | step (ms) | vs fastest tp=2 | CPU ms / step | exposed comm (ms / step) "
           f"| first-step loss | vs single | loss after {n} steps | other load | runs |"),
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "unavailable" in r:
            out.append(f"| {r['name']} | not available: {r['unavailable']} | | | | | | | | |")
            continue
        ratio = f"{r['step_ms'] / fastest:.2f}" if fastest else ""
        comm = f"{r['exposed_comm_ms']:.1f}" if r["exposed_comm_ms"] is not None else ""
        delta = r["first_loss"] - ref if ref is not None else None
        check = "" if delta is None else (f"{delta:+.1e}" + ("" if abs(delta) <= LOSS_TOL else " **DIFFERS**"))
        noisy = "" if r.get("quiet", True) else " (noisy)"
        out.append(f"| {r['name']} | {r['step_ms']:.0f}{noisy} | {ratio} | {r['cpu_ms']:.0f} | {comm} | "
                   f"{r['first_loss']:.6f} | {check} | {r['last_loss']:.6f} | {r['other_load']:.0%} "
                   f"| {r.get('runs', 1)} |")
    return "\n".join(out)


def markdown(rows: list[dict], setup: Setup, command: str, machine: dict, params: int,
             slow_link: float = 0.0) -> str:
    from zero_report import command_and_machine

    s = setup
    title = "## Tensor parallelism: torch TP, DeepSpeed AutoTP and meshspeed, tp=2 (`benchmarks/tensor_parallel.py`)"
    if slow_link:
        title = f"### meshspeed's overlap on a simulated link of {slow_link:g} ms/MB (`--slow-link`)"
    lines = [
        title,
        "",
        *([(f"Every collective of the meshspeed runs also occupies a simulated link for 0.1 ms + "
           f"{slow_link:g} ms per MB moved, without using the CPU (Note [a link that does not take the "
           "CPU] in the script): on this machine's own loopback the collectives use the cores the GEMMs "
           "need, so overlap has nothing free to run on."), ""] if slow_link else []),
        (f"A randomly initialised `transformers` LlamaForCausalLM with {params / 1e6:.2f}M parameters "
        f"(hidden {s.hidden_size}, SwiGLU {s.intermediate_size}, {s.num_layers} layers, {s.num_heads} query / "
        f"{s.num_kv_heads} key-value heads, vocabulary {s.vocab_size}, untied head), fp32, batch "
        f"{s.micro_batch} x {s.seq_len} tokens per step (the tp group's one batch), AdamW (lr {s.lr}, weight "
        f"decay {s.weight_decay}, torch's fused kernel everywhere), no clipping. Every implementation loads "
        "the same initial weights and token batches (Note [one init, one batch file] in the script) and runs "
        "in its own fresh processes: 2 gloo ranks, one intra-op thread each (`single`: one process, no TP). "
        f"Step time is rank 0's median over {s.steps} timed steps after {s.warmup} warm-up steps; each step "
        "is forward + backward + optimizer step, started at an untimed barrier."),
        *command_and_machine(command, machine),
        table(rows, setup),
        "",
        ("- **torch-tp**: `parallelize_module` with torchtitan's Llama plan (q/k/v, gate/up column-parallel; "
        "o, down row-parallel; vocabulary-sharded embedding; column-parallel head gathered to full logits). "
        "**-sp**: sequence parallelism (norms on T/2 tokens, reduce-scatter + all-gather instead of all-reduce). "
        "**-lp**: loss parallelism (the head's logits stay vocabulary-sharded into the cross-entropy)."),
        ("- **deepspeed-autotp**: `deepspeed.initialize` with `\"tensor_parallel\": {\"autotp_size\": 2}` and "
        "ZeRO stage 0; AutoTP reads the model's HF `tp_plan` (the embedding stays replicated, the head is "
        "column-parallel with gathered output)."),
        ("- **meshspeed-tp**: `meshspeed.initialize` with `\"tensor_parallel\": {\"autotp_size\": 2}`; **-sp** "
        "adds `\"sequence_parallel\": true`, **-overlap** `\"tp_overlap_comm\": true`."),
        ("- **exposed comm**: time the training thread spent blocked in collectives per step, from meshspeed's "
        "comm-layer timer (Note [exposed communication]), the larger of the ranks' medians; it includes time "
        "spent waiting for the peer to reach the collective, not only the transfer. torch and DeepSpeed have "
        "no such timer."),
        "- **vs single**: first-step loss minus the one-process reference's (tolerance 1e-4).",
        "- **other load**: share of the machine's CPU other processes used during the timed steps.",
        "",
    ]
    return "\n".join(lines)


def write_docs(section: str, path: Path, key: str = "tensor_parallel.py") -> None:
    from zero_report import replace_section

    replace_section(section, path, key)


# -- entry point --------------------------------------------------------------------------------


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20, help="timed steps")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps before timing")
    ap.add_argument("--quick", action="store_true", help="2 warm-up + 4 timed steps, one run, no idle wait")
    ap.add_argument("--variants", default=",".join(ALL), help=f"comma-separated, from {','.join(ALL)}")
    ap.add_argument("--repeats", type=int, default=1, help="run the list this many times, keep the fastest")
    ap.add_argument("--quiet-load", type=float, default=0.05,
                    help="a run is quiet when other processes used at most this share of the machine")
    ap.add_argument("--wait-idle", type=float, default=30.0, metavar="SECONDS",
                    help="before each run, wait up to this long for the machine to be <20%% busy")
    ap.add_argument("--markdown", action="store_true", help="print the docs/benchmarks.md section")
    ap.add_argument("--write-docs", action="store_true",
                    help="replace the section in docs/benchmarks.md and write benchmarks/results/tensor-parallel.json")
    ap.add_argument("--deepspeed-python", default=None, metavar="PYTHON",
                    help="interpreter with DeepSpeed (default: the one ../shared/tools/anchor-venv.sh prints)")
    # DeepSpeed's venv side of spawn_in_venv
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--slow-link", type=float, default=0.0, metavar="MS_PER_MB",
                    help="meshspeed runs only: add a simulated link of this many ms per MB "
                         "(Note [a link that does not take the CPU])")
    ap.add_argument("--setup-json", help=argparse.SUPPRESS)
    ap.add_argument("--inputs", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def run_variant(name: str, setup: Setup, inputs: str, deepspeed_python: str | None, why_no_ds: str) -> dict:
    if name in DEEPSPEED:
        if deepspeed_python is None:
            return {"name": name, "unavailable": why_no_ds}
        return summarise(name, spawn_in_venv(deepspeed_python, name, setup, inputs))
    return summarise(name, spawn(name, setup, inputs))


def main(argv=None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.worker:
        result = spawn(args.worker, Setup(**json.loads(args.setup_json)), args.inputs)
        Path(args.worker_out).write_text(json.dumps(result))
        return
    setup = Setup(warmup=args.warmup, steps=args.steps)
    if args.quick:
        setup = replace(setup, warmup=2, steps=4)
        args.repeats, args.wait_idle = 1, 0.0
    names = [n for n in args.variants.split(",") if n]
    if args.slow_link:
        os.environ["MESHSPEED_BENCH_SLOW_LINK"] = str(args.slow_link)  # the spawned ranks read it
        names = [n for n in names if n.startswith("meshspeed")]
    if unknown := [n for n in names if n not in ALL]:
        sys.exit(f"unknown variant(s) {unknown}; choose from {ALL}")
    ds_python, ds_version = None, ""
    if any(n in DEEPSPEED for n in names):
        ds_python, ds_version = find_deepspeed_python(args.deepspeed_python)
        if ds_python is None:
            print(f"DeepSpeed skipped: {ds_version}", flush=True)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        inputs = str(Path(tmp) / "inputs.pt")  # Note [one init, one batch file]
        model = build_model(setup)
        params = sum(p.numel() for p in model.parameters())
        torch.save({"state_dict": model.state_dict(), "batches": make_batches(setup, setup.warmup + setup.steps)},
                   inputs)
        del model
        for rep in range(args.repeats):
            for name in names:
                wait_until_idle(args.wait_idle)
                t0 = time.time()
                r = run_variant(name, setup, inputs, ds_python, ds_version)
                runs[name].append(r)
                got = (f"not available: {r['unavailable']}" if "unavailable" in r else
                       f"step {r['step_ms']:.0f} ms, cpu {r['cpu_ms']:.0f} ms, first loss {r['first_loss']:.6f}, "
                       f"other load {r['other_load']:.0%}")
                print(f"[{rep + 1}/{args.repeats}] {name:24s} {got}  [{time.time() - t0:.0f}s]", flush=True)
    rows = [pick(runs[n], args.quiet_load) for n in names]
    print()
    print(table(rows, setup))
    from zero_report import machine_description

    machine = machine_description()
    if ds_python:
        machine["deepspeed"] = f"{ds_version} (its own venv, {ds_python})"
    command = " ".join([".venv/bin/python", "benchmarks/tensor_parallel.py", *(argv if argv is not None else sys.argv[1:])])
    section = markdown(rows, setup, command, machine, params, args.slow_link)
    if args.markdown:
        print()
        print(section)
    if args.write_docs:
        key = "tensor_parallel.py slow-link" if args.slow_link else "tensor_parallel.py"
        write_docs(section, REPO / "docs" / "benchmarks.md", key)
        out = REPO / "benchmarks" / "results" / ("tensor-parallel-slow-link.json" if args.slow_link
                                                 else "tensor-parallel.json")
        out.write_text(json.dumps({"command": command, "machine": machine, "setup": asdict(setup), "params": params,
                                   "results": rows, "all_runs": runs}, indent=1))
        print(f"wrote docs/benchmarks.md (tensor_parallel.py section) and {out.relative_to(REPO)}")


if __name__ == "__main__":
    main()
