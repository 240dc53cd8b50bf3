"""Summaries, targets and the markdown section that `zero.py` writes."""

from __future__ import annotations

import hashlib
import os
import platform
import statistics
import subprocess
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
MIB = 2**20
START, END = "<!-- zero.py:start -->", "<!-- zero.py:end -->"


def machine_description() -> dict[str, str]:
    cpu = platform.processor() or "unknown CPU"
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout.splitlines():
            if line.startswith("Model name:"):
                cpu = line.split(":", 1)[1].strip()
    except OSError:
        pass
    mem_kb = next((int(l.split()[1]) for l in Path("/proc/meminfo").read_text().splitlines()
                   if l.startswith("MemTotal:")), 0)
    try:
        git = ["git", "-C", str(REPO)]
        commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False).stdout.strip()
        dirty = subprocess.run([*git, "status", "--porcelain", "meshspeed"], capture_output=True, text=True, check=False).stdout
        if dirty.strip():  # name the exact working tree: a hash of the diff against HEAD
            diff = subprocess.run([*git, "diff", "HEAD", "--", "meshspeed"], capture_output=True,
                                  check=False).stdout
            commit += f" + uncommitted changes in meshspeed/ (diff sha1 {hashlib.sha1(diff).hexdigest()[:10]})"
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
    """One framework's run (every rank's raw numbers) -> the numbers the report shows."""
    r0 = ranks[0]
    states = [r["state"] for r in ranks]
    state = -1 if any(v < 0 for s in states for v in s.values()) else max(sum(s.values()) for s in states)
    return {
        "framework": name,
        "median_step_s": statistics.median(r0["step_s"]),
        "median_step_s_per_rank": [statistics.median(r["step_s"]) for r in ranks],
        "median_cpu_s": max(statistics.median(r["cpu_s"]) for r in ranks),
        "other_load": r0["other_load"],
        "peak_rss_mib": max(r["peak_rss_kb"] for r in ranks) / 1024,
        "peak_rss_delta_mib": max(r["peak_rss_kb"] - r["baseline_rss_kb"] for r in ranks) / 1024,
        "model_state_bytes": state,
        "model_state_by_category": r0["state"],
        "losses": r0["losses"],
        "step_s": r0["step_s"],
        "peak_reset": all(r["peak_reset"] for r in ranks),
        "peak_gathered_bytes": max(r["peak_gathered_bytes"] for r in ranks),
    }


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b > 0 and a >= 0 else "n/a"


def _mib(n: float) -> str:
    return f"{n / MIB:.2f}" if n >= 0 else "n/a"


def targets(rows: dict[str, dict], psi: int, world: int, key: str = "median_step_s") -> list[dict]:
    """The goals of issue 3, each {target, measured, verdict, frameworks}; `key` picks the
    time measure (wall or CPU); the memory goal is listed with the wall-clock ones only."""
    out = []

    def add(target, measured, met, *names):
        out.append({"target": target, "measured": measured, "verdict": "met" if met else "not met",
                    "frameworks": list(names)})

    ddp = rows.get("ddp")
    for s in (1, 2):
        r = rows.get(f"meshspeed-{s}")
        if r and ddp:
            rel = r[key] / ddp[key] - 1
            add(f"meshspeed-{s} step within 5% of DDP", f"{rel:+.1%}", rel <= 0.05, f"meshspeed-{s}", "ddp")
    for z3_name in ("meshspeed-3", "meshspeed-3-t1e5"):
        z3 = rows.get(z3_name)
        if not z3:
            continue
        for other in ("fsdp2", "deepspeed-3"):
            r = rows.get(other)
            if r:
                faster = 1 - z3[key] / r[key]
                add(f"{z3_name} at least 15% faster than {other}", f"{faster:+.1%} faster",
                    faster >= 0.15, z3_name, other)
        if key == "median_step_s":
            ideal = 16 * psi / world
            rel = z3["model_state_bytes"] / ideal - 1
            add(f"{z3_name} model state within 5% of 16Ψ/N",
                f"{_mib(z3['model_state_bytes'])} MiB vs {_mib(ideal)} MiB ({rel:+.1%})", abs(rel) <= 0.05)
    return out


def render_markdown(rows: dict[str, dict], setup, world: int, psi: int, command: str,
                    machine: dict[str, str], skipped: dict[str, str], quiet_load: float) -> str:
    ddp = rows["ddp"]
    lines = [
        "## ZeRO stages against DDP, FSDP2 and DeepSpeed (`benchmarks/zero.py`)",
        "",
        (f"GPT with Ψ = {psi:,} parameters (vocab {setup.vocab_size}, d_model {setup.d_model}, "
         f"{setup.n_layer} layers, {setup.n_head} heads, sequence {setup.seq_len}), fp32, AdamW "
         f"(lr {setup.lr}, weight decay {setup.weight_decay}, fused={setup.fused} everywhere), "
         f"micro-batch {setup.micro_batch} per rank, {world} ranks on gloo, one intra-op thread per "
         "rank. The same seed and the same byte "
         "windows of the Python standard library for every framework. Each framework runs in fresh "
         "processes (Note [one spawn per framework] in the script). Step time is the median over "
         f"{setup.steps} timed steps after {setup.warmup} warm-up steps, on rank 0. Of the runs of "
         "a framework (the `runs` column), the table shows the fastest quiet one: other processes "
         f"used at most {quiet_load:.0%} of the machine during its timed steps; **noisy** marks a "
         "framework that had no quiet run, whose wall clock is then the fastest noisy run's "
         "(Note [timing on a shared machine] in the script)."),
        "",
        "```",
        command,
        "```",
        "",
        "Machine: " + "; ".join(f"{k} {v}" for k, v in machine.items()) + ".",
        "",
        ("| framework | step (s) | vs DDP | CPU s / step | vs DDP | other load | runs | peak RSS (MiB) "
         "| above baseline (MiB) | vs DDP | model state (MiB) | vs DDP |"),
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        lines.append(
            f"| {name} | {r['median_step_s']:.3f} | {_ratio(r['median_step_s'], ddp['median_step_s'])} "
            f"| {r['median_cpu_s']:.3f} | {_ratio(r['median_cpu_s'], ddp['median_cpu_s'])} "
            f"| {r['other_load']:.0%}{'' if r.get('quiet', True) else ' **noisy**'} "
            f"| {len(r.get('all_runs', [r]))} | {r['peak_rss_mib']:.0f} "
            f"| {r['peak_rss_delta_mib']:.0f} | {_ratio(r['peak_rss_delta_mib'], ddp['peak_rss_delta_mib'])} "
            f"| {_mib(r['model_state_bytes'])} | {_ratio(r['model_state_bytes'], ddp['model_state_bytes'])} |"
        )
    for name, why in skipped.items():
        lines.append(f"| {name} | skipped: {why} |" + " |" * 11)
    lines += [
        "",
        ("- **step**: wall clock of forward + backward + optimizer step, ranks started together "
         "by a barrier that is not timed."),
        ("- **CPU s / step**: CPU time of the rank's process (all its threads, gloo's included) "
         "per step, the larger of the ranks. It leaves out time spent waiting for the peer or "
         "for a core, so it is the measure to trust when **other load** is high."),
        ("- **other load**: share of the machine's CPU time used by processes other than the "
         "benchmark's ranks during the timed steps. Above a few percent the wall-clock columns "
         "measure the neighbours as much as the framework."),
        ("- **peak RSS**: largest per-rank high-water mark (VmHWM); **above baseline**: the same "
         "minus the rank's RSS just before the model was built (torch, gloo and the data are "
         "already loaded then)."),
        ("- **model state**: params + grads + optimizer state resident on the rank (the larger "
         "of the ranks), counted from the tensors after backward and before the optimizer step. "
         f"16Ψ = {_mib(16 * psi)} MiB and 16Ψ/N = {_mib(16 * psi / world)} MiB. DDP's own "
         "gradient buckets (another 4Ψ) are not reachable from Python and are not in its "
         "model-state column; they are in its RSS."),
        "",
        "Model state by category (rank 0, MiB):",
        "",
        "| framework | params | grads | optimizer state | peak gathered stage-3 params |",
        "|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        c, g = r["model_state_by_category"], r.get("peak_gathered_bytes", -1)
        lines.append(f"| {name} | {_mib(c['params'])} | {_mib(c['grads'])} | {_mib(c['optimizer_state'])} "
                     f"| {_mib(g) if g > 0 else ''} |")
    lines += ["", "### Targets", "",
              "Wall clock (the measure issue 3 names), and CPU time per step (robust to other load):",
              "", "| target | wall clock | verdict | CPU time | verdict |", "|---|---|---|---|---|"]
    cpu = {t["target"]: t for t in targets(rows, psi, world, key="median_cpu_s")}
    for t in targets(rows, psi, world):
        c = cpu.get(t["target"], {"measured": "", "verdict": ""})
        noisy = any(not rows[n].get("quiet", True) for n in t["frameworks"])
        lines.append(f"| {t['target']} | {t['measured']} | {t['verdict']}{' (noisy)' if noisy else ''} "
                     f"| {c['measured']} | {c['verdict']} |")
    lines += ["", "### Losses (rank 0)", "",
              ("All frameworks are fp32 from the same weights on the same data, so their losses "
               "should agree to float rounding."), "",
              "| framework | " + " | ".join(f"step {i}" for i in range(5)) + " | last step | max abs diff vs DDP |",
              "|---|" + "---|" * 7]
    for name, r in rows.items():
        diff = max(abs(a - b) for a, b in zip(r["losses"], ddp["losses"]))
        first = [f"{l:.6f}" for l in r["losses"][:5]] + [""] * (5 - len(r["losses"][:5]))
        lines.append(f"| {name} | " + " | ".join(first)
                     + f" | {r['losses'][-1]:.6f} | {diff:.2e} |")
    return "\n".join(lines) + "\n"


def write_docs(section: str, path: Path) -> None:
    """Replace this benchmark's section of the markdown file at `path`, keeping any others."""
    block = f"{START}\n{section}{END}\n"
    old = path.read_text() if path.exists() else "# Benchmarks\n"
    if START in old and END in old:
        head, rest = old.split(START, 1)
        tail = rest.split(END, 1)[1].lstrip("\n")
        new = head + block + ("\n" + tail if tail else "")
    else:
        new = old.rstrip("\n") + "\n\n" + block
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(new)
