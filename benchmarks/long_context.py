"""Long-context training over the context-parallel axis: activation memory, bytes per layer
against the papers' formulas, step time, and the longest sequence a fixed memory cap per
rank admits, for Ulysses, Ring Attention (contiguous and load-balanced) and the hybrid.

    .venv/bin/python benchmarks/long_context.py --json --write-docs --with-deepspeed   # about 9 minutes on 2 cores
    .venv/bin/python benchmarks/long_context.py --degrees 1 2 --methods ring --skip-search   # a quick look
    .venv/bin/python benchmarks/long_context.py --render benchmarks/results/long_context.json --write-docs

meshspeed's GPT (`--layers` 2 blocks of d_model `--d-model` 256, `--heads` 8 heads of 32,
`--kv-heads` for grouped-query attention, vocabulary 256, SwiGLU), fp32, AdamW, ZeRO stage
1, no clipping, one sequence per step, trained by `meshspeed.initialize` on P gloo ranks of
this machine (dp = 1), one intra-op thread each. Degree 1 is the plain model in one process
(no `context_parallel` section), the same baseline for every method; at P > 1 the config
has `"context_parallel": {"size": P, "mode": method}` (hybrid: `"ulysses_size": 2`, so only
at P >= 4) and the engine cuts each (1, S) batch over the ranks. Each (method, P) runs in a
fresh set of processes (long_context_worker.py): one memory step, `--warmup` steps, `--steps`
timed steps, one counted step, at S = `--seq-len`. Then the search of Note [the memory cap].

Note [activation memory, measured]
"Saved" is pipeline.py's Note [activation memory, measured] for one training step: the peak
bytes of distinct storages held by tensors autograd saved for backward, parameters
excluded, per rank (the largest rank). The ring's custom Function saves through the same
hooks (its q, k, v, out, lse); Ulysses' all-to-all saves nothing. Beside it, the peak growth
of the rank's RSS during the same step, sampled every 2 ms by a thread from /proc/self/statm:
the saved tensors plus every transient (the attention kernels' work buffers, gradients,
the optimizer's temporaries). Both are taken on the first step at S after one step at
`--warm-len` tokens, as a trial of the search sees it.

Note [malloc for memory measurements]
meshspeed fixes glibc's mmap threshold at 4 MiB (Note [a fixed mmap threshold for CPU
training] in meshspeed/process/malloc.py): smaller blocks come from glibc's heap, which
keeps freed blocks resident, so one step's RSS growth would depend on what earlier steps
left there. For the memory step and the search the ranks set the threshold to 128 KiB and
return the free heap (`mallopt`, `malloc_trim`): every block of 128 KiB or more is then
mapped when allocated and unmapped when freed, and RSS and VmData follow the bytes in use.
Step times are taken with meshspeed's own 4 MiB (the low threshold costs page faults:
about 25% on the degree-1 step here).

Note [bytes per layer]
CommCounter's bytes (Note [ring bytes] in meshspeed/comm/counter.py: what this rank sends;
an all-to-all over n ranks sends (n-1)/n of its input, a send its tensor) of one training
step, forward and backward apart, the context-parallel ops only (all_to_all, send; recv
equals send), divided by the layers. The gradient all-reduce / reduce-scatter / all-gather
and the loss average are the "sync" column, per step. With s = S/P tokens per rank, head
dim d, h query heads, h_kv key/value heads, e = 4 bytes (fp32), b = 1:
  Ulysses (u = P): q, k, v in one all-to-all, the output in a second; k and v carry
    h_kv' = h_kv heads, or u when h_kv < u (replicated so each rank finds its head):
    forward = (u-1)/u * e*s*d*(h + 2 h_kv') + (u-1)/u * e*s*d*h, backward the same (each
    all-to-all's gradient goes back the same way). With h_kv = h this is
    4 (P-1)/P * e*S*H/P for H = h*d: the DeepSpeed-Ulysses paper's 4NH/P (section 3.2,
    arXiv:2309.14509) is the message per link of an aggregate 4NH, i.e. all P ranks' 1/P
    shares, the one a rank keeps included; the rank sends (P-1)/P of it.
  Ring (r = P; ring and ring_balanced alike): forward r-1 hops of the rank's K and V,
    2*e*h_kv*s*d each; backward r-1 hops of K and V again plus r hops of the owner's dK,
    dV, which travel in the accumulation dtype (fp32 here, e_acc = 4): (r-1)*2*e*h_kv*s*d
    + r*2*e_acc*h_kv*s*d. The Ring Attention paper (arXiv:2310.01889) counts the forward's
    (P-1) K/V blocks, 2(P-1)NH/P per host; causal skipping does not skip a hop.
  Hybrid (u = 2 all-to-all, r = P/2 ring): the Ulysses terms over u, then the ring terms
    over r on blocks of h_kv'/u heads x u*s tokens (the same element count as a rank's own
    k); the papers' forward is 4NH/P + 2(r-1)NH/P.
The benchmark asserts measured == formula for every method and degree.

Note [ranks forked from a preloaded server]
Every set of ranks is forked from one multiprocessing fork server that imported torch,
torch._dynamo (torch.optim's first optimizer imports it: seconds on this machine) and
meshspeed's modules once (`PRELOAD` in long_context_worker.py), so a trial costs its steps,
not four interpreters' imports on two cores. Each set is still fresh processes: the server
runs no torch op, and each rank builds its own engine and process group.

Note [p = 4 on two cores]
As in pipeline.py: four ranks on this machine's two cores are oversubscribed, so P = 4 step
times measure time sharing as much as the split (each rank's share of the work is 1/4, but
it gets half a core). P = 2 has a core per rank. Memory and bytes do not depend on speed.

Note [the memory cap]
A trial is one fresh set of P processes: build, one step at `--warm-len` tokens (optimizer
state, gloo's threads and buffers, code loaded), low mmap threshold (Note [malloc for
memory measurements]), then RLIMIT_DATA = the rank's VmData + `--budget` (Linux counts
private writable mappings, the heap and every mmap'd tensor, against it) and one training
step at S. A refused allocation is torch's RuntimeError "can't allocate memory"; that rank
records it and exits, the parent ends its peers (they would wait on it; `comms_timeout` is
also short). A length fits when every rank finishes the step. The search starts from the
measured step's growth per token (at P > 1 at most twice the length that fitted at P/2),
multiplies by `--grow` until a length fails (or divides until one fits), then bisects to
`--resolution` in multiples of `--granule` tokens. Before it, a probe checks that the cap
makes torch's allocator refuse on this machine; if it does not, the trials compare each
rank's sampled RSS growth with the budget instead, and the report says so.

Note [the ring's score blocks]
Ring attention's kernel (meshspeed/sequence/block_attention.py) is, in float32 on the CPU,
torch's flash kernel for one block pair (Note [a fused kernel on the CPU] there), whose work
buffers are a few tiles, as degree 1's scaled_dot_product_attention and Ulysses' local
attention are. Its first version materialised the scores of a whole block pair, [h, L_q,
L_k] floats, twice in backward: a transient quadratic in the tokens per rank, with which
the rings at P = 2 fit no longer a sequence than degree 1 under the cap (3072 and 4096
tokens against 4864). That is what this benchmark found and why the kernel changed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # siblings, also in spawned ranks

from long_context_worker import (
    CP_OPS,
    METHODS,
    SYNC_OPS,
    Job,
    Model,
    cap_works,
    preload,
    run_measure,
    run_trial,
)

REPO = Path(__file__).resolve().parent.parent
MIB = 2**20
DOCS_KEY = "long_context.py"


# -- formulas (Note [bytes per layer]) -----------------------------------------------------------


def split(method: str, degree: int) -> tuple[int, int]:
    """(all-to-all degree u, ring degree r) of a method at a degree."""
    if degree == 1 or method == "baseline":
        return 1, 1
    u = {"ulysses": degree, "hybrid": 2}.get(method, 1)
    return u, degree // u


def kv_heads_sent(kv_heads: int, u: int) -> int:
    """k/v heads through an all-to-all over u ranks: replicated up to u when fewer."""
    return kv_heads if kv_heads % u == 0 else u


def formula(method: str, degree: int, seq_len: int, m: Model, e: int = 4, e_acc: int = 4) -> dict:
    """Bytes this rank sends per layer, {"forward": {op: bytes}, "backward": {op: bytes}}."""
    from meshspeed.comm.counter import ring_bytes

    u, r = split(method, degree)
    s, d, h = seq_len // degree, m.head_dim, m.n_head
    kv = kv_heads_sent(m.kv_heads, u) if u > 1 else m.kv_heads
    a2a = 0
    if u > 1:
        a2a = ring_bytes("all_to_all", e * s * d * (h + 2 * kv), u) + ring_bytes("all_to_all", e * s * d * h, u)
    block = 2 * (kv // u) * (u * s) * d  # elements of one ring member's K and V
    fwd = (r - 1) * e * block
    bwd = (r - 1) * e * block + (r * e_acc * block if r > 1 else 0)
    return {"forward": {"all_to_all": a2a, "send": fwd}, "backward": {"all_to_all": a2a, "send": bwd}}


def paper_forward(method: str, degree: int, seq_len: int, m: Model, e: int = 4) -> int:
    """The papers' forward volume per layer, in bytes: 4NH/P (Ulysses), 2(P-1)NH/P (Ring
    Attention's K/V), both on their sub-groups for the hybrid; H_kv for k and v."""
    u, r = split(method, degree)
    n, hq, hkv = seq_len, m.n_head * m.head_dim, m.kv_heads * m.head_dim
    ulysses = (2 * n * hq + 2 * n * hkv) // degree if u > 1 else 0
    ring = 2 * (r - 1) * n * hkv // degree
    return e * (ulysses + ring)


def check_bytes(row: dict, m: Model) -> dict:
    """Measured cp bytes per layer (every rank) against the formula; raises on a mismatch."""
    job = row["job"]
    want = formula(job["method"], job["degree"], job["seq_len"], m)
    got = {"forward": {}, "backward": {}}
    for phase in ("forward", "backward"):
        for op in ("all_to_all", "send"):
            per_rank = [c[phase][op] for c in row["comm_bytes"]]
            if any(b % m.n_layer for b in per_rank) or len(set(per_rank)) != 1:
                raise AssertionError(f"{job['method']} P={job['degree']}: {phase} {op} bytes {per_rank} are not "
                                     f"one equal per-layer value on every rank")
            got[phase][op] = per_rank[0] // m.n_layer
        recv = {c[phase]["recv"] for c in row["comm_bytes"]}
        if recv != {got[phase]["send"] * m.n_layer}:
            raise AssertionError(f"{job['method']} P={job['degree']}: {phase} recv {recv} != send")
    if got != want:
        raise AssertionError(f"{job['method']} P={job['degree']} S={job['seq_len']}: measured bytes per layer {got} "
                             f"!= formula {want} (Note [bytes per layer])")
    if any(c["step"][op] for c in row["comm_bytes"] for op in CP_OPS):
        raise AssertionError(f"{job['method']} P={job['degree']}: context-parallel traffic in the optimizer step")
    sync = max(sum(c[p][op] for p in ("forward", "backward", "step") for op in SYNC_OPS) for c in row["comm_bytes"])
    return {"measured": got, "formula": want, "sync_bytes_per_step": sync,
            "paper_forward": paper_forward(job["method"], job["degree"], job["seq_len"], m)}


# -- the search (Note [the memory cap]) -----------------------------------------------------------


def search(method: str, degree: int, m: Model, args, start: int, mode: str, log) -> dict:
    """Longest S (a multiple of the granule) whose one training step fits the budget."""
    g, budget = args.granule, int(args.budget * MIB)
    trials: list[dict] = []

    def fits(s: int) -> bool:
        job = Job(method, degree, s, m, comms_timeout=args.comms_timeout)
        t = run_trial(job, budget, args.warm_len, mode, args.trial_timeout)
        trials.append({"seq_len": s, "status": t["status"], "seconds": round(t["seconds"], 1),
                       "ranks": t["ranks"]})
        log(f"    S={s:6d}: {t['status']:7s} [{t['seconds']:.0f}s]")
        if t["status"] == "error":
            details = [r["detail"] for r in t["ranks"] if r and r["status"] == "error"]
            raise RuntimeError(f"{method} P={degree} S={s}: a rank failed with something other than the cap: "
                               f"{details}")
        return t["status"] == "fits"

    def snap(s: float) -> int:
        return max(g, int(s) // g * g)

    lo = hi = None
    s = snap(start)
    if fits(s):
        lo = s
        while hi is None:
            s = snap(lo * args.grow) if snap(lo * args.grow) > lo else lo + g
            if fits(s):
                lo = s
            else:
                hi = s
    else:
        hi = s
        while lo is None and hi > g:
            s = snap(hi / args.grow) if snap(hi / args.grow) < hi else hi - g
            if fits(s):
                lo = s
            else:
                hi = s
        if lo is None:
            return {"method": method, "degree": degree, "longest": 0, "first_failing": g, "trials": trials}
    while hi - lo > max(g, args.resolution * lo):
        mid = snap((lo + hi) / 2)
        if mid in (lo, hi):
            break
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return {"method": method, "degree": degree, "longest": lo, "first_failing": hi, "trials": trials}


# -- the plan ----------------------------------------------------------------------------------------


def plan(methods: list[str], degrees: list[int]) -> list[tuple[str, int]]:
    """(method, degree) to run: the baseline once at degree 1, hybrid only where u = 2 < P."""
    out = [("baseline", 1)] if 1 in degrees else []
    for p in sorted(d for d in degrees if d > 1):
        out += [(mth, p) for mth in methods if mth != "hybrid" or (p % 2 == 0 and p > 2)]
    return out


DEEPSPEED_ARGS = ["--degrees", "2", "--seq", "2048", "--repeats", "3"]  # its "quick look"


def with_deepspeed(args) -> dict:
    """benchmarks/ulysses_ds.py (meshspeed's DistributedAttention beside DeepSpeed's, its
    own benchmark), when it is in this checkout: the table and parity lines it prints."""
    script = REPO / "benchmarks" / "ulysses_ds.py"
    if not script.exists():
        return {"skipped": f"{script.relative_to(REPO)} is not in this checkout"}
    cmd = [sys.executable, str(script), *(args.deepspeed_args or DEEPSPEED_ARGS)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False)
    if done.returncode:
        return {"skipped": f"`{' '.join(cmd[1:])}` exited {done.returncode}: {done.stderr.strip()[-500:]}"}
    keep = [line for line in done.stdout.splitlines() if line.startswith(("|", "P=", "DeepSpeed skipped"))]
    return {"command": " ".join([".venv/bin/python", "benchmarks/ulysses_ds.py", *cmd[2:]]),
            "output": "\n".join(keep)}


# -- the report -------------------------------------------------------------------------------------


def _name(method: str, degree: int) -> str:
    if method == "baseline":
        return "degree 1 (plain GPT)"
    return f"hybrid {2}x{degree // 2}" if method == "hybrid" else method


def _by(rows: list[dict]) -> dict[tuple[str, int], dict]:
    return {(r["job"]["method"], r["job"]["degree"]): r for r in rows}


def memory_table(rows: list[dict]) -> list[str]:
    base = _by(rows).get(("baseline", 1))
    lines = ["| method | P | tokens / rank | saved MiB | saved / P=1 | 1/P | RSS growth MiB | RSS / P=1 |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        j = r["job"]
        saved, rss = (f"{r[k] / base[k]:.3f}" if base else "n/a" for k in ("saved_peak_bytes", "rss_growth_bytes"))
        lines.append(f"| {_name(j['method'], j['degree'])} | {j['degree']} | {j['seq_len'] // j['degree']} "
                     f"| {r['saved_peak_bytes'] / MIB:.1f} | {saved} | {1 / j['degree']:.3f} "
                     f"| {r['rss_growth_bytes'] / MIB:.1f} | {rss} |")
    return lines


def bytes_table(rows: list[dict]) -> list[str]:
    def mib(n: int) -> str:
        return f"{n / MIB:.3f}" if n else "0"

    lines = [("| method | P | all-to-all fwd / bwd | send fwd / bwd | formula fwd / bwd | = | paper's forward "
              "| measured fwd / paper | grad + loss sync MiB / step |"), "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        j, b = r["job"], r["bytes"]
        got, want, paper = b["measured"], b["formula"], b["paper_forward"]
        fwd = sum(got["forward"].values())
        lines.append(
            f"| {_name(j['method'], j['degree'])} | {j['degree']} "
            f"| {mib(got['forward']['all_to_all'])} / {mib(got['backward']['all_to_all'])} "
            f"| {mib(got['forward']['send'])} / {mib(got['backward']['send'])} "
            f"| {mib(sum(want['forward'].values()))} / {mib(sum(want['backward'].values()))} "
            f"| {'yes' if got == want else '**no**'} | {mib(paper)} | {f'{fwd / paper:.3f}' if paper else 'n/a'} "
            f"| {b['sync_bytes_per_step'] / MIB:.2f} |")
    return lines


def time_table(rows: list[dict]) -> list[str]:
    base = _by(rows).get(("baseline", 1))
    lines = ["| method | P | step ms | vs P=1 | CPU ms / step (busiest rank) | vs P=1 | other load |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        j = r["job"]
        wall, cpu = (f"{r[k] / base[k]:.2f}" if base else "n/a" for k in ("median_step_s", "median_cpu_s"))
        lines.append(f"| {_name(j['method'], j['degree'])} | {j['degree']} | {1e3 * r['median_step_s']:.0f} | {wall} "
                     f"| {1e3 * r['median_cpu_s']:.0f} | {cpu} | {r['other_load']:.0%} |")
    return lines


def fit_table(fits: list[dict]) -> tuple[list[str], list[str]]:
    """The longest S per method and degree, and a verdict per method."""
    got = {(f["method"], f["degree"]): f for f in fits}
    degrees = sorted({f["degree"] for f in fits})
    base = got.get(("baseline", 1))
    lines = ["| method | " + " | ".join(f"P = {p}" for p in degrees) + " | longer with every doubling |",
             "|---|" + "---|" * (len(degrees) + 1)]
    verdicts = []
    for method in [m for m in METHODS if any(f["method"] == m for f in fits)]:
        chain = [base] if base else []
        chain += [got[(method, p)] for p in degrees if (method, p) in got]
        cells = []
        for p in degrees:
            f = base if p == 1 else got.get((method, p))
            none = "n/a (P >= 4)" if method == "hybrid" else ""
            cells.append(f"{f['longest']} ({f['longest'] // p} / rank; {f['first_failing']} fails)" if f else none)
        steps = list(itertools.pairwise(chain))
        grows = all(b["longest"] > a["longest"] for a, b in steps)
        lines.append(f"| {method} | " + " | ".join(cells) + f" | {'yes' if grows else '**no**'} |")
        for a, b in steps:
            if b["longest"] <= a["longest"]:
                verdicts.append(f"{method}: P = {b['degree']} fits {b['longest']} tokens, not more than "
                                f"P = {a['degree']}'s {a['longest']}.")
    return lines, verdicts


def loss_line(rows: list[dict]) -> str:
    base = _by(rows).get(("baseline", 1))
    if not base:
        return ""
    worst = max(abs(a - b) for r in rows for a, b in zip(r["losses"], base["losses"]))
    return (f"Same weights and data for every row: the timed steps' losses differ from degree 1's by at most "
            f"{worst:.1e}.")


def print_tables(result: dict) -> None:
    rows = result["rows"]
    for table in (memory_table(rows), bytes_table(rows), time_table(rows)):
        print("\n".join(table))
    if result["fits"]:
        lines, verdicts = fit_table(result["fits"])
        print("\n".join(lines + verdicts))
    print(loss_line(rows))
    ds = result.get("deepspeed")
    if ds:
        print(ds.get("output") or f"ulysses_ds.py skipped: {ds['skipped']}")


def _paragraphs(text: str) -> list[str]:
    """Lines with a blank one wherever a table starts or ends, so markdown keeps them apart."""
    out: list[str] = []
    for line in text.strip().splitlines():
        if out and out[-1] and out[-1].startswith("|") != line.startswith("|"):
            out.append("")
        out.append(line)
    return out


def markdown(result: dict) -> str:
    from zero_report import command_and_machine

    m, a, rows = Model(**result["model"]), result["args"], result["rows"]
    loads = [r["other_load"] for r in rows]
    lines = [
        "## Long context: Ulysses, Ring Attention and the hybrid over the cp axis (`benchmarks/long_context.py`)",
        "",
        (f"meshspeed's GPT: {m.n_layer} blocks of d_model {m.d_model}, {m.n_head} heads of {m.head_dim}"
         f"{f', {m.kv_heads} key/value heads' if m.kv_heads != m.n_head else ''}, SwiGLU, vocabulary "
         f"{m.vocab_size}; fp32, AdamW, ZeRO stage {m.zero_stage}, one sequence per step, "
         "`meshspeed.initialize` on P gloo ranks (dp = 1), one intra-op thread each. Degree 1 is the plain model "
         "in one process, the baseline of every method; at P > 1 `\"context_parallel\": {\"size\": P, "
         "\"mode\": ...}` (hybrid: `ulysses_size` 2, all-to-all inside pairs, the ring across them) and the engine "
         f"cuts each sequence. Tables 1-3 at S = {a['seq_len']}: each configuration in fresh processes, one memory "
         f"step, {a['warmup']} warm-up step(s), {a['steps']} timed steps, one step with its bytes counted. The "
         "Notes named here are in the script's docstring."),
    ]
    lines += command_and_machine(result["command"], result["machine"])
    lines += [
        "### Activation memory per rank",
        "",
        ("Saved: peak bytes of tensors saved for backward alive at once in one training step (parameters "
         "excluded), the largest rank. RSS growth: the step's peak RSS above the RSS before it, sampled every 2 ms, "
         "glibc's mmap threshold at 128 KiB so that freed blocks leave RSS (Note [activation memory, measured], "
         "Note [malloc for memory measurements])."),
        "",
        *memory_table(rows),
        "",
        ("Saved bytes fall as 1/P for every method: each rank keeps its own tokens' activations and nothing of "
         "its peers' (the ring re-fetches K/V blocks in backward rather than keeping them). RSS adds the "
         "transients (all-to-all and ring buffers, gradients, the optimizer's temporaries); every attention "
         "kernel here is torch's tiled flash kernel (Note [the ring's score blocks])."),
        "",
        "### Context-parallel bytes per rank per layer (MiB), against the formulas",
        "",
        ("CommCounter's bytes sent by one rank in one training step, forward and backward apart, divided by "
         "the layers; recv equals send. Formula: Note [bytes per layer]; the benchmark asserts measured == formula. "
         "Paper's forward: DeepSpeed-Ulysses' 4NH/P, Ring Attention's 2(P-1)NH/P (with H_kv for k and v); "
         "Ulysses sends (P-1)/P of it (the paper's per-link volume counts the share a rank keeps). Sync: the "
         "gradient reduce-scatter / all-gather of ZeRO 1 over the P ranks and the loss average, per step."),
        "",
        *bytes_table(rows),
        "",
        "### Step time",
        "",
        ("Median over the timed steps of the slowest rank's forward + backward + optimizer step, each started at "
         "a barrier. P = 4 runs four ranks on two cores (Note [p = 4 on two cores]): its times measure time "
         f"sharing as much as the split. Other processes used {min(loads):.0%} to {max(loads):.0%} of the "
         "machine's CPU during the timed steps (this machine is shared): where that is high, the CPU time of the "
         "busiest rank (its process's threads, waits excluded) is the steadier measure."),
        "",
        *time_table(rows),
        "",
        loss_line(rows),
        "",
    ]
    if result["fits"]:
        table, verdicts = fit_table(result["fits"])
        trials = sum(len(f["trials"]) for f in result["fits"])
        how = ("RLIMIT_DATA at each rank's VmData + the budget, after a warm-up step; a length fits when every "
               "rank finishes one training step" if result["cap"]["mode"] == "cap" else
               f"the RLIMIT_DATA probe failed on this machine ({result['cap']['probe']}), so each rank's sampled "
               "RSS growth of one step is compared with the budget")
        lines += [
            f"### Longest sequence under a {a['budget']:g} MiB cap per rank",
            "",
            (f"{how} (Note [the memory cap]); multiples of {a['granule']} tokens, bisected to "
             f"{a['resolution']:.0%}; {trials} trials, each in fresh processes. A cell: the longest S that trained "
             "a step (tokens per rank; the shortest length that did not)."),
            "",
            *table,
            "",
        ]
        if verdicts:
            lines += ["Where it does not grow: " + " ".join(verdicts), ""]
    ds = result.get("deepspeed")
    if ds:
        lines += ["### Ulysses beside DeepSpeed's DistributedAttention (`benchmarks/ulysses_ds.py`)", ""]
        lines += ([f"Skipped: {ds['skipped']}", ""] if "skipped" in ds else [
            "```", ds["command"], "```", "",
            ("Its own benchmark, run by `--with-deepspeed`: both frameworks' `DistributedAttention` in the same "
             "ranks, one forward + backward call each, median ms of the slowest rank; ratio = meshspeed / "
             "DeepSpeed; attention: causal SDPA inside, exchange: a trivial local attention, so the layer's "
             "all-to-alls and copies alone (its docstring's Notes)."), "", *_paragraphs(ds["output"]), ""])
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--degrees", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--seq-len", type=int, default=2048, help="S of the measured runs")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: --heads)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per configuration")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per configuration")
    ap.add_argument("--wait-idle", type=float, default=3.0, metavar="SECONDS",
                    help="before the timed steps, wait up to this long for the machine to be <20%% busy")
    ap.add_argument("--warm-len", type=int, default=256, help="tokens of the step before a memory step or trial")
    ap.add_argument("--budget", type=float, default=256.0, help="memory cap per rank above its baseline, MiB")
    ap.add_argument("--granule", type=int, default=256, help="sequence lengths searched are multiples of this")
    ap.add_argument("--grow", type=float, default=1.2, help="factor per trial until the search brackets")
    ap.add_argument("--resolution", type=float, default=0.05, help="stop bisecting below this relative gap")
    ap.add_argument("--trial-timeout", type=float, default=180.0, help="seconds a trial's processes may take")
    ap.add_argument("--comms-timeout", type=float, default=30.0, help="comms_timeout of the engines, seconds")
    ap.add_argument("--skip-search", action="store_true", help="no memory-cap search")
    ap.add_argument("--with-deepspeed", action="store_true", help="also run benchmarks/ulysses_ds.py")
    ap.add_argument("--deepspeed-args", nargs=argparse.REMAINDER, default=[],
                    help=f"arguments for ulysses_ds.py, the rest of the command line (default: "
                         f"{' '.join(DEEPSPEED_ARGS)})")
    ap.add_argument("--json", nargs="?", const=str(REPO / "benchmarks" / "results" / "long_context.json"),
                    default=None, metavar="PATH", help="write the results (default benchmarks/results/long_context.json)")
    ap.add_argument("--render", metavar="JSON", default=None, help="run nothing: the docs section from a --json file")
    ap.add_argument("--markdown", action="store_true", help="print the docs section")
    ap.add_argument("--write-docs", action="store_true", help="replace the section in docs/benchmarks.md")
    args = ap.parse_args(argv)
    if args.render:
        saved = json.loads(Path(args.render).read_text())
        section = markdown(saved)
        print(section)
        if args.write_docs:
            write_docs(section)
        return
    if args.granule % (2 * max(args.degrees)):
        ap.error(f"--granule {args.granule} must be a multiple of 2 x the largest degree")
    preload()
    m = Model(n_layer=args.layers, d_model=args.d_model, n_head=args.heads, n_kv_head=args.kv_heads)
    t_start = time.time()

    def log(line: str) -> None:
        print(f"{line}", flush=True)

    rows = []
    for method, p in plan(args.methods, args.degrees):
        t0 = time.time()
        row = run_measure(Job(method, p, args.seq_len, m, args.comms_timeout), args.warmup, args.steps, args.warm_len,
                          args.wait_idle)
        row["bytes"] = check_bytes(row, m)
        rows.append(row)
        b = row["bytes"]["measured"]
        log(f"{method:13s} P={p}: step {row['median_step_s']:.3f}s (other load {row['other_load']:.0%}) saved "
            f"{row['saved_peak_bytes'] / MIB:.1f} MiB rss +{row['rss_growth_bytes'] / MIB:.1f} MiB, cp bytes/layer "
            f"fwd {sum(b['forward'].values())} bwd {sum(b['backward'].values())} = formula  [{time.time() - t0:.0f}s]")
    fits, cap = [], {"mode": "skipped"}
    if not args.skip_search:
        ok, why = cap_works()
        cap = {"mode": "cap" if ok else "rss", "probe": why}
        log(f"memory cap: RLIMIT_DATA probe {why}; searching with mode {cap['mode']!r}, budget {args.budget:g} MiB")
        longest: dict[tuple[str, int], int] = {}
        for row in rows:
            job = row["job"]
            method, p = job["method"], job["degree"]
            # per-token growth of the measured step, capped by twice the length half the degree fitted
            start = args.budget * MIB * job["seq_len"] / max(row["data_growth_bytes"], 1)
            prev = longest.get((method, p // 2), longest.get(("baseline", 1)))
            if p > 1 and prev:
                start = min(start * 1.25, 2 * prev)
            log(f"  {method} P={p} (from S={int(start)})")
            fits.append(search(method, p, m, args, start, cap["mode"], log))
            longest[(method, p)] = fits[-1]["longest"]
            log(f"  {job['method']} P={job['degree']}: longest S {fits[-1]['longest']}, "
                f"{fits[-1]['first_failing']} does not fit")
    deepspeed = with_deepspeed(args) if args.with_deepspeed else None
    from zero_report import machine_description

    command = " ".join([".venv/bin/python", "benchmarks/long_context.py", *(argv if argv is not None else sys.argv[1:])])
    saved_args = {k: v for k, v in vars(args).items() if k not in ("render", "markdown", "write_docs", "json")}
    result = {"command": command, "machine": machine_description(), "model": asdict(m), "args": saved_args,
              "rows": rows, "fits": fits, "cap": cap, "deepspeed": deepspeed,
              "seconds": round(time.time() - t_start)}
    print_tables(result)
    log(f"done in {time.time() - t_start:.0f}s")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
        log(f"wrote {args.json}")
    section = markdown(result)
    if args.markdown:
        print(section)
    if args.write_docs:
        write_docs(section)


def write_docs(section: str) -> None:
    from zero_report import replace_section

    replace_section(section, REPO / "docs" / "benchmarks.md", DOCS_KEY)
    print(f"wrote docs/benchmarks.md ({DOCS_KEY} section)")


if __name__ == "__main__":
    main()
