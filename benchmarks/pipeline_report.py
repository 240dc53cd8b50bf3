"""The report half of benchmarks/pipeline.py: the bubble formulas, the summary of one
configuration's ranks, and the markdown tables of docs/benchmarks.md's pipeline.py section
(also `pipeline.py --render results.json`, which rebuilds it without running anything)."""

from __future__ import annotations

import statistics
from pathlib import Path

from pipeline_worker import ModelConfig

MIB = 2**20


# -- figures -----------------------------------------------------------------------------------------


def formula(schedule: str, p: int, m: int, v: int) -> float:
    if schedule == "interleaved":
        return (p - 1) / (v * m + p - 1)
    if schedule == "zb-h1":
        return (p - 1) / (3 * m + p - 1)
    return (p - 1) / (m + p - 1)


def simulated(schedule: str, p: int, m: int, v: int, t: dict[str, float]):
    """`simulate` of the schedule with the measured pass times (chunk times x v: simulate
    divides a stage's t_F by v)."""
    from meshspeed.parallel.pipeline.schedule import build, fuse_adjacent_halves, simulate

    plan = build(schedule, m, p, v)
    if schedule == "zb-h1":  # as executed: the first stage's I/W pairs run as B
        plan = [fuse_adjacent_halves(actions) for actions in plan]
        return simulate(plan, t_forward=t["F"], t_backward=t["I"] + t["W"], t_weight=t["W"])
    return simulate(plan, t_forward=t["F"] * v, t_backward=t["B"] * v, virtual_stages=v)


def summarise(ranks: list[dict]) -> dict:
    r0 = ranks[0]
    s, p, m, v = r0["schedule"], r0["stages"], r0["micro_batches"], r0["virtual_stages"]
    per_batch = [max(col) for col in zip(*(r["step_s"] for r in ranks))]  # the slowest rank's
    sim = simulated(s, p, m, v, r0["pass_s"])
    memory = sorted((r["memory"] for r in ranks), key=lambda x: x["stage"])
    for mem in memory:
        mem["bound_micro_batches"] = sim.peak_in_flight[mem["stage"]] / v
        mem["in_flight"] = mem["peak_bytes"] / mem["micro_batch_bytes"] if mem["micro_batch_bytes"] else None
    return {"schedule": s, "stages": p, "micro_batches": m, "virtual_stages": v,
            "median_step_s": statistics.median(per_batch), "step_s": per_batch, "losses": r0["losses"],
            "other_load": r0["other_load"], "median_cpu_s": max(statistics.median(r["cpu_s"]) for r in ranks),
            "bubble_measured": statistics.median(r0["bubbles"]), "bubbles": r0["bubbles"],
            "bubble_formula": formula(s, p, m, v), "bubble_simulated": sim.bubble_fraction,
            "pass_ms": {k: 1e3 * t for k, t in r0["pass_s"].items()}, "memory": memory,
            "stage_params": [r["stage_params"] for r in ranks], "timeline": r0["timeline"]}


def _name(row: dict) -> str:
    return f"interleaved v={row['virtual_stages']}" if row["schedule"] == "interleaved" else row["schedule"]


def bubble_table(rows: list[dict]) -> list[str]:
    lines = ["| p | m | schedule | measured | formula | simulated (measured t) | pass ms F / B ; I + W |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        t = r["pass_ms"]
        passes = f"{t['F']:.1f} / " + " ; ".join(
            ([f"{t['B']:.1f}"] if "B" in t else []) + ([f"{t['I']:.1f} + {t['W']:.1f}"] if "I" in t else []))
        lines.append(f"| {r['stages']} | {r['micro_batches']} | {_name(r)} | {r['bubble_measured']:.3f} | "
                     f"{r['bubble_formula']:.3f} | {r['bubble_simulated']:.3f} | {passes} |")
    return lines


def memory_table(rows: list[dict]) -> list[str]:
    lines = [("| p | m | schedule | one micro-batch MiB, per stage | peak MiB, per stage | peak / one micro-batch "
              "| bound (micro-batches in flight) |"), "|---|---|---|---|---|---|---|"]
    for r in rows:
        mem = r["memory"]
        worth = " / ".join(f"{x['micro_batch_bytes'] / MIB:.2f}" for x in mem)
        peak = " / ".join(f"{x['peak_bytes'] / MIB:.1f}" for x in mem)
        in_flight = " / ".join(f"{x['in_flight']:.2f}" if x["in_flight"] else "n/a" for x in mem)
        bound = " / ".join(f"{x['bound_micro_batches']:g}" for x in mem)
        lines.append(f"| {r['stages']} | {r['micro_batches']} | {_name(r)} | {worth} | {peak} | {in_flight} | {bound} |")
    return lines


def step_table(rows: list[dict], ds: dict | None, p: int) -> list[str]:
    ds_by_m = {r["micro_batches"]: r for r in (ds or {}).get("results", [])}
    names = [n for n in ["1f1b", "gpipe", "interleaved", "zb-h1"] if any(r["schedule"] == n for r in rows)]
    head = "| m | " + " | ".join(f"meshspeed {n} ms" for n in names) + " | DeepSpeed 1f1b ms | " + \
        " | ".join(f"{n} / DS" for n in names) + " |"
    lines = [head, "|" + "---|" * (2 + 2 * len(names))]
    for m in sorted({r["micro_batches"] for r in rows if r["stages"] == p}):
        got = {r["schedule"]: r for r in rows if r["stages"] == p and r["micro_batches"] == m}
        ds_ms = 1e3 * ds_by_m[m]["median_step_s"] if m in ds_by_m else None
        cells = [f"{1e3 * got[n]['median_step_s']:.0f}" if n in got else "n/a" for n in names]
        ratios = [f"{1e3 * got[n]['median_step_s'] / ds_ms:.2f}" if n in got and ds_ms else "n/a" for n in names]
        lines.append(f"| {m} | " + " | ".join(cells) + f" | {f'{ds_ms:.0f}' if ds_ms else 'n/a'} | "
                     + " | ".join(ratios) + " |")
    return lines


def cpu_table(rows: list[dict], ds: dict | None, p: int) -> list[str]:
    """CPU seconds a batch took on its busiest rank, in the runs of the step table."""
    ds_by_m = {r["micro_batches"]: r for r in (ds or {}).get("results", [])}
    names = [n for n in ["1f1b", "gpipe", "interleaved", "zb-h1"] if any(r["schedule"] == n for r in rows)]
    lines = ["| m | " + " | ".join(f"meshspeed {n}" for n in names) + " | DeepSpeed 1f1b | 1f1b / DS |",
             "|" + "---|" * (3 + len(names))]
    for m in sorted({r["micro_batches"] for r in rows if r["stages"] == p}):
        got = {r["schedule"]: r for r in rows if r["stages"] == p and r["micro_batches"] == m}
        cells = [f"{1e3 * got[n]['median_cpu_s']:.0f}" if n in got else "n/a" for n in names]
        d = ds_by_m.get(m)
        ds_cpu = f"{1e3 * d['median_cpu_s']:.0f}" if d else "n/a"
        ratio = f"{got['1f1b']['median_cpu_s'] / d['median_cpu_s']:.2f}" if d and "1f1b" in got else "n/a"
        lines.append(f"| {m} | " + " | ".join(cells) + f" | {ds_cpu} | {ratio} |")
    return lines


def runs_table(rows: list[dict], ds: dict | None, p: int) -> list[str]:
    """Every run's median step (and the other processes' share of the CPU meanwhile)."""
    def cell(runs):
        return ", ".join(f"{1e3 * r['median_step_s']:.0f} ({r['other_load']:.0%})" for r in runs)

    lines = ["| m | run | each run's median ms (other load) |", "|---|---|---|"]
    for m in sorted({r["micro_batches"] for r in rows if r["stages"] == p}):
        for r in rows:
            if r["stages"] == p and r["micro_batches"] == m:
                lines.append(f"| {m} | meshspeed {_name(r)} | {cell(r.get('all_runs', [r]))} |")
        for r in (ds or {}).get("results", []):
            if r["micro_batches"] == m:
                lines.append(f"| {m} | DeepSpeed 1f1b | {cell(r.get('all_runs', [r]))} |")
    return lines


def targets(rows: list[dict], ds: dict | None, p: int) -> list[str]:
    ds_by_m = {r["micro_batches"]: r["median_step_s"] for r in (ds or {}).get("results", [])}
    out = []
    for m in sorted({r["micro_batches"] for r in rows if r["stages"] == p}):
        got = {r["schedule"]: r["median_step_s"] for r in rows if r["stages"] == p and r["micro_batches"] == m}
        if "1f1b" in got and m in ds_by_m:
            ratio = got["1f1b"] / ds_by_m[m]
            out.append(f"- m={m}: meshspeed 1F1B at most 1.0x DeepSpeed's step: {ratio:.2f}x, "
                       f"{'met' if ratio <= 1.0 else 'not met'}.")
        if "zb-h1" in got and "1f1b" in got:
            best = min([got["1f1b"], *([ds_by_m[m]] if m in ds_by_m else [])])
            out.append(f"- m={m}: ZB-H1 faster than both 1F1B runs: {1e3 * got['zb-h1']:.0f} ms against "
                       f"{1e3 * best:.0f} ms, {'met' if got['zb-h1'] < best else 'not met'}.")
    return out


def markdown(rows, ds, cfg: ModelConfig, args, command: str, machine: dict) -> str:
    from zero_report import command_and_machine

    p_time = args.deepspeed_stages
    params = sum(next(r for r in rows)["stage_params"])
    loads = [r["other_load"] for r in rows if r["stages"] == p_time]
    loads += [r["other_load"] for r in (ds or {}).get("results", [])]
    lines = [
        ("## Pipeline schedules as executed: bubble, activation memory, step time beside DeepSpeed "
         "(`benchmarks/pipeline.py`)"),
        "",
        (f"The GPT of `benchmarks/pipeline_worker.py`: {cfg.n_layer} pre-norm blocks of d_model {cfg.d_model} "
         f"({cfg.n_head} heads, GELU MLP 4x), vocabulary {cfg.vocab_size}, untied head, {params / 1e6:.2f}M "
         f"parameters; a micro-batch is {cfg.micro_batch} sequences of {cfg.seq_len} tokens; fp32, AdamW "
         f"(lr {cfg.lr}, torch's fused kernel), no clipping, ZeRO 0; the stages cut at the blocks "
         "(`partition_method=\"type:Block\"`), the same layers and data under both frameworks. One gloo rank "
         f"per stage, one intra-op thread each. Per configuration {args.warmup} warm-up batch(es), "
         f"{args.steps} timed batches (step time: the median of the slowest rank's `train_batch`, optimizer "
         f"step included; with `--repeats {args.repeats}` the fastest of the runs), then one more batch for "
         "the memory count."),
    ]
    lines += command_and_machine(command, machine)
    lines += [
        ("p = 4 runs four ranks on this machine's two cores (Note [p = 4 on two cores] in the script): its "
         "bubbles are of time-shared wall clock and its step times are not compared; step times are taken "
         f"at p = {p_time}. Other processes used {min(loads):.0%} to {max(loads):.0%} of the machine's CPU "
         f"during the p = {p_time} timed batches (`other_load` in benchmarks/results/pipeline.json)."
         if loads else "p = 4 runs four ranks on this machine's two cores."),
        "",
        "### Bubble: measured against the formula",
        "",
        ("Measured: the idle share of the executed timeline, median over the timed batches. Formula: "
         "(p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(vm+p-1) interleaved, (p-1)/(3m+p-1) ZB-H1 (t_F = t_I = "
         "t_W). Simulated: `schedule.simulate` with the run's median pass times (per chunk for "
         "interleaved), no communication cost. Note [bubble, measured]."),
        "",
        *bubble_table(rows),
        "",
        "### Activation memory per stage",
        "",
        ("Peak bytes of saved-for-backward tensors alive at once during one batch, per stage (parameters "
         "excluded; ZB-H1's (x, dy) queued for the weight pass included); one micro-batch's worth is what "
         "one micro-batch's forwards on that stage save; the bound is the schedule's micro-batches in "
         "flight (`simulate`'s peak; interleaved: chunk forwards / v). Note [activation memory, measured]."),
        "",
        *memory_table(rows),
        "",
        f"### Step time at p = {p_time} beside DeepSpeed {ds['deepspeed'] if ds else ''} (1F1B)",
        "",
    ]
    if ds is None:
        lines += [f"DeepSpeed skipped: {args.deepspeed_skipped}", ""]
    lines += step_table(rows, ds, p_time)
    lines += ["", (f"Each cell: the fastest of the {args.repeats} run(s) (meshspeed and DeepSpeed in turn); every "
                   "run, with the share of the machine's CPU that other processes took during its timed batches:"),
              "", *runs_table(rows, ds, p_time), "",
              ("CPU ms a batch took on its busiest rank (median over the timed batches, the runs of the first table); "
               "other processes inflate it less than the wall clock, so on a shared machine its ratio is the "
               "steadier comparison:"),
              "", *cpu_table(rows, ds, p_time)]
    if ds:
        ds_loss = {r["micro_batches"]: r["ranks"][0]["losses"] for r in ds["results"]}
        ms_loss = {r["micro_batches"]: r["losses"] for r in rows if r["stages"] == p_time and r["schedule"] == "1f1b"}
        same = [m for m in ds_loss if m in ms_loss]
        if same:
            worst = max(abs(a - b) for m in same for a, b in zip(ds_loss[m], ms_loss[m]))
            lines += ["", (f"Same model and data: the timed batches' losses of meshspeed 1F1B and DeepSpeed "
                           f"differ by at most {worst:.1e}.")]
    lines += ["", "### Targets", "", *targets(rows, ds, p_time), ""]
    if args.findings and Path(args.findings).exists():
        lines += [Path(args.findings).read_text().rstrip(), ""]
    return "\n".join(lines)


def write_docs(section: str, path: Path, key: str = "pipeline.py", measured: str | None = None) -> None:
    from zero_report import replace_section

    replace_section(section, path, key, measured)
