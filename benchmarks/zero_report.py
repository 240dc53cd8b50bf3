"""Summaries, targets and the markdown section that `zero.py` writes."""

from __future__ import annotations

import hashlib
import os
import platform
import re
import statistics
import subprocess
from pathlib import Path

import torch
from docs_stamp import begin, require_committed, stamp_line

REPO = Path(__file__).resolve().parent.parent
MIB = 2**20
STATE = ("params", "grads", "optimizer_state")  # model state; comm buffers are shown apart
LEGACY = "default-fp32-2"  # the run the unkeyed markers of older reports held


def markers(key: str | None) -> tuple[str, str]:
    """The comments around one run's section of docs/benchmarks.md (None: the unkeyed ones)."""
    tag = "zero.py" if key is None else f"zero.py:{key}"
    return f"<!-- {tag}:start -->", f"<!-- {tag}:end -->"


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
    try:  # the tree as it was when the run began (docs_stamp.begin), not when it ended
        commit = begin()
        if commit.endswith("+dirty"):  # name the exact working tree: a hash of the diff against HEAD
            diff = subprocess.run(["git", "-C", str(REPO), "diff", "HEAD", "--", "meshspeed"], capture_output=True,
                                  check=False).stdout
            commit += f" (uncommitted changes; meshspeed/ diff sha1 {hashlib.sha1(diff).hexdigest()[:10]})"
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


def command_and_machine(command: str, machine: dict[str, str]) -> list[str]:
    """The markdown lines every benchmark section carries: the command that made it, then
    the machine it ran on (`machine_description()`), blank lines around both."""
    return ["", "```", command, "```", "",
            "Machine: " + "; ".join(f"{k} {v}" for k, v in machine.items()) + ".", ""]


def summarise(name: str, ranks: list[dict]) -> dict:
    """One framework's run (every rank's raw numbers) -> the numbers the report shows."""
    r0 = ranks[0]
    states = [{k: r["state"].get(k, -1) for k in STATE} for r in ranks]
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


# peak RSS above baseline, per rank, as a share of DDP's: at most this much
MEMORY_TARGETS = {"meshspeed-1": 0.85, "meshspeed-2": 0.85, "meshspeed-3": 0.7, "meshspeed-3-t1e5": 0.7}


def paired_ratio(a: dict, b: dict, key: str) -> float:
    """a's time over b's (Note [paired ratios] in zero.py): the median over rounds of the
    ratio within each round, when both ran in every round of `--repeats`; else the ratio
    of the figures the table shows."""
    ra, rb = a.get("rounds") or [], b.get("rounds") or []
    if len(ra) >= 2 and len(ra) == len(rb):
        return statistics.median(x[key] / y[key] for x, y in zip(ra, rb))
    return a[key] / b[key]


def targets(rows: dict[str, dict], psi: int, world: int, key: str = "median_step_s") -> list[dict]:
    """The goals of issue 3, each {target, measured, verdict, frameworks}; `key` picks the
    time measure (wall or CPU); the memory goals are listed with the wall-clock ones only."""
    out = []

    def add(target, measured, met, *names):
        out.append({"target": target, "measured": measured, "verdict": "met" if met else "not met",
                    "frameworks": list(names)})

    ddp = rows.get("ddp")
    for s in (1, 2):
        r = rows.get(f"meshspeed-{s}")
        if r and ddp:
            rel = paired_ratio(r, ddp, key) - 1
            add(f"meshspeed-{s} step within 5% of DDP", f"{rel:+.1%}", rel <= 0.05, f"meshspeed-{s}", "ddp")
    for z3_name in ("meshspeed-3", "meshspeed-3-t1e5"):
        z3 = rows.get(z3_name)
        if not z3:
            continue
        for other in ("fsdp2", "deepspeed-3", "deepspeed-3-t0"):
            r = rows.get(other)
            if r:
                faster = 1 - paired_ratio(z3, r, key)
                add(f"{z3_name} at least 15% faster than {other}", f"{faster:+.1%} faster",
                    faster >= 0.15, z3_name, other)
        if key == "median_step_s":
            ideal = 16 * psi / world
            rel = z3["model_state_bytes"] / ideal - 1
            add(f"{z3_name} model state within 5% of 16Ψ/N",
                f"{_mib(z3['model_state_bytes'])} MiB vs {_mib(ideal)} MiB ({rel:+.1%})", abs(rel) <= 0.05)
    if key == "median_step_s" and ddp and ddp["peak_rss_delta_mib"] > 0:
        base = ddp["peak_rss_delta_mib"]
        for name, most in MEMORY_TARGETS.items():
            r = rows.get(name)
            if r:
                share = r["peak_rss_delta_mib"] / base
                add(f"{name} peak RSS above baseline at most {most:.2f}x DDP's",
                    f"{r['peak_rss_delta_mib']:.0f} MiB vs {base:.0f} MiB ({share:.2f}x)", share <= most)
    return out


PRECISION = {
    "fp32": "fp32 everywhere",
    "bf16": ("bf16 compute with fp32 master weights and AdamW on the masters, each framework "
             "in its natural bf16 mode: meshspeed and DeepSpeed with `\"bf16\": {\"enabled\": true}` "
             "(the model cast to bf16; meshspeed all-reduces / reduce-scatters gradients in fp32, "
             "DeepSpeed in bf16, both their defaults); **ddp** is torch DDP over the bf16 model "
             "with a comm hook that all-reduces each bucket in fp32 and makes the averaged fp32 "
             "gradients those of an fp32 master copy of every parameter, which AdamW steps and "
             "which is then copied back into the bf16 model (meshspeed stage 0's arithmetic); "
             "**fsdp2** is `fully_shard` over the fp32 model with "
             "`MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)` (its sharded fp32 "
             "parameters are the masters; the rotary tables stay fp32 there)"),
}


def render_markdown(rows: dict[str, dict], setup, world: int, psi: int, command: str,
                    machine: dict[str, str], skipped: dict[str, str], quiet_load: float) -> str:
    ddp = rows["ddp"]
    lines = [
        (f"## ZeRO stages against DDP, FSDP2 and DeepSpeed: shape `{setup.shape}`, {setup.precision}, "
         f"{world} ranks (`benchmarks/zero.py`)"),
        "",
        (f"GPT with Ψ = {psi:,} parameters (shape `{setup.shape}`: vocab {setup.vocab_size}, "
         f"d_model {setup.d_model}, {setup.n_layer} layers, {setup.n_head} heads, sequence "
         f"{setup.seq_len}), {PRECISION[setup.precision]}. AdamW "
         f"(lr {setup.lr}, weight decay {setup.weight_decay}, fused={setup.fused} everywhere, "
         "DeepSpeed through `\"torch_adam\": true`), no gradient clipping, "
         f"micro-batch {setup.micro_batch} per rank, {world} ranks on gloo, one intra-op thread per "
         "rank. The same seed and the same byte "
         "windows of the Python standard library for every framework. Each framework runs in fresh "
         "processes (Note [one spawn per framework] in the script); DeepSpeed's in its own venv "
         "(built by `../shared/tools/anchor-venv.sh`), importing this checkout's model and data. "
         "Step time is the median over "
         f"{setup.steps} timed steps after {setup.warmup} warm-up steps, on rank 0. Of the runs of "
         "a framework (the `runs` column), the table shows the fastest quiet one: other processes "
         f"used at most {quiet_load:.0%} of the machine during its timed steps; **noisy** marks a "
         "framework that had no quiet run, whose wall clock is then the fastest noisy run's "
         "(Note [timing on a shared machine] in the script)."),
        *command_and_machine(command, machine),
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
        ("- **peak RSS**: largest per-rank high-water mark (VmHWM); **above baseline** (the "
         "memory headline): the same minus the rank's RSS just before the model was built "
         "(torch, the process group, the data and the framework's modules are already loaded "
         "then; for DeepSpeed also its comm layer, `deepspeed.init_distributed`), the larger of the ranks, measured the "
         "same way for every framework."),
        ("- **model state**: params (master weights included) + grads + optimizer state resident "
         "on the rank (the larger of the ranks), counted from the tensors after backward and "
         "before the optimizer step. "
         f"16Ψ = {_mib(16 * psi)} MiB and 16Ψ/N = {_mib(16 * psi / world)} MiB. DDP's own "
         "gradient buckets (another Ψ gradients' worth) are not reachable from Python and are not "
         "in its model-state column; they are in its RSS. DeepSpeed's is counted from its ZeRO "
         "optimizer's buffers (`deepspeed_state_bytes` in `zero_frameworks.py`); stages 1 and 2 "
         "keep a separate fp32 master partition even in fp32 (4Ψ/N more than meshspeed)."),
        "",
        ("Model state by category (rank 0, MiB). **comm buffers** are not in the model state "
         "above: meshspeed's gradient reduction buffers (in bf16 at stage 0 they hold the "
         "fp32 master gradients), the bf16 DDP baseline's fp32 reduced gradients, DeepSpeed stage 3's reduce "
         "bucket (allocated whole at reduce_bucket_size = 5e8 elements but only touched as far "
         "as it is filled, so RSS sees a fraction of it):"),
        "",
        "| framework | params | grads | optimizer state | comm buffers | peak gathered stage-3 params |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        c, g = r["model_state_by_category"], r.get("peak_gathered_bytes", -1)
        comm = c.get("comm_buffers", -1)
        lines.append(f"| {name} | {_mib(c.get('params', -1))} | {_mib(c.get('grads', -1))} "
                     f"| {_mib(c.get('optimizer_state', -1))} | {_mib(comm) if comm > 0 else ''} "
                     f"| {_mib(g) if g > 0 else ''} |")
    lines += ["", "### Targets", "",
              ("Wall clock (the measure issue 3 names), and CPU time per step (robust to other "
               "load); the memory targets compare peak RSS above baseline per rank:"),
              "", "| target | wall clock / measured | verdict | CPU time | verdict |", "|---|---|---|---|---|"]
    cpu = {t["target"]: t for t in targets(rows, psi, world, key="median_cpu_s")}
    for t in targets(rows, psi, world):
        c = cpu.get(t["target"], {"measured": "", "verdict": ""})
        noisy = any(not rows[n].get("quiet", True) for n in t["frameworks"])
        lines.append(f"| {t['target']} | {t['measured']} | {t['verdict']}{' (noisy)' if noisy else ''} "
                     f"| {c['measured']} | {c['verdict']} |")
    agree = ("All frameworks are fp32 from the same weights on the same data, so their losses "
             "should agree to float rounding." if setup.precision == "fp32" else
             "In bf16 the losses agree only to bf16 rounding: the frameworks round in different "
             "places (where gradients are reduced, in which dtype, whether buffers are cast), so "
             "differences of order 1e-3 to 1e-2 are expected; meshspeed stage 0 and the DDP "
             "baseline do the same arithmetic.")
    lines += ["", "### Losses (rank 0)", "", agree, "",
              "| framework | " + " | ".join(f"step {i}" for i in range(5)) + " | last step | max abs diff vs DDP |",
              "|---|" + "---|" * 7]
    for name, r in rows.items():
        diff = max(abs(a - b) for a, b in zip(r["losses"], ddp["losses"]))
        first = [f"{l:.6f}" for l in r["losses"][:5]] + [""] * (5 - len(r["losses"][:5]))
        lines.append(f"| {name} | " + " | ".join(first)
                     + f" | {r['losses'][-1]:.6f} | {diff:.2e} |")
    return "\n".join(lines) + "\n"


def stamped(section: str, path: Path, measured: str | None = None) -> str:
    """`section` with the commit it was measured on named in it: `measured` (a re-render of
    an earlier run's results), else this run's commit, refused if it has uncommitted code
    and `path` is in this repository (docs_stamp.require_committed)."""
    in_repo = path.resolve().is_relative_to(REPO)
    commit = measured or (require_committed() if in_repo else begin())
    if re.search(r"commit\W{0,3}[0-9a-f]{7,}", section):  # the section names its commit already
        return section
    return stamp_line(commit) + "\n\n" + section


def replace_section(section: str, path: Path, key: str, measured: str | None = None) -> None:
    """Put `section` between `<!-- key:start -->` and `<!-- key:end -->` in the markdown file
    at `path`, replacing what was there, or append it with its markers (every benchmark's
    docs/benchmarks.md section but zero.py's, which keeps its runs together: write_docs).
    The section names the commit it was measured on (`stamped`)."""
    section = stamped(section, path, measured)
    start, end = f"<!-- {key}:start -->", f"<!-- {key}:end -->"
    block = f"{start}\n{section}{end}\n"
    old = path.read_text()
    if start in old and end in old:
        head, rest = old.split(start, 1)
        tail = rest.split(end, 1)[1].lstrip("\n")  # block ends in a newline: none added per rewrite
        new = head + block + ("\n" + tail if tail else "")
    else:
        new = old.rstrip("\n") + "\n\n" + block
    path.write_text(new)


def write_docs(section: str, path: Path, key: str | None = None) -> None:
    """Replace the section of run `key` (e.g. default-fp32-2) in the markdown file at `path`,
    keeping every other; a new key's section goes after the last zero.py section (or at the
    end). The unkeyed markers of older reports are taken to be the default-fp32-2 run's."""
    section = stamped(section, path)
    start, end = markers(key)
    block = f"{start}\n{section}{end}\n"
    old = path.read_text() if path.exists() else "# Benchmarks\n"
    legacy_start, legacy_end = markers(None)
    if start not in old and key == LEGACY and legacy_start in old and legacy_end in old:
        start, end = legacy_start, legacy_end
    if start in old and end in old:
        head, rest = old.split(start, 1)
        tail = rest.split(end, 1)[1].lstrip("\n")
        new = head + block + ("\n" + tail if tail else "")
    else:
        ends = list(re.finditer(r"<!-- zero\.py(:[\w.-]+)?:end -->\n?", old))
        if ends:  # keep the zero.py sections together
            cut = ends[-1].end()
            new = old[:cut].rstrip("\n") + "\n\n" + block + "\n" + old[cut:].lstrip("\n")
        else:
            new = old.rstrip("\n") + "\n\n" + block
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(new)
