"""Switching mid-training, both ways, side by side: DeepSpeed 0.19.8 <-> meshspeed.

    PYTHONPATH=. .venv/bin/python benchmarks/ds_checkpoint_roundtrip.py [--write-docs] [--quick]
    PYTHONPATH=. .venv/bin/python benchmarks/ds_checkpoint_roundtrip.py --docs-from-json  # table only

For ZeRO 1/2/3 x dp 1/2/4 in fp32, plus one bf16 case per direction:

(a) deepspeed -> meshspeed: DeepSpeed trains SAVE_AT steps and saves; a fresh DeepSpeed
    engine loads the files and trains MORE steps (the reference); a fresh meshspeed engine
    at the same dp and stage loads the same files and trains the same MORE steps.
(b) meshspeed -> deepspeed: meshspeed trains SAVE_AT steps and saves with
    `"checkpoint": {"format": "deepspeed"}` (each tag also holds DeepSpeed's files); a
    fresh meshspeed engine loads its own files and trains MORE steps (the reference); a
    fresh DeepSpeed engine at the same dp and stage loads the DeepSpeed files of the same
    tag and trains the same MORE steps.

The model, batches, config and training loop are benchmarks/ds_checkpoint_import.py's
(a tiny seeded MLP, one fixed global batch of 4 rows per step split over the dp ranks,
Adam + WarmupLR, `"gradient_clipping": 1.0` said explicitly: DeepSpeed 0.19.8 clips at 1.0
when the key is missing, meshspeed's default is 0). To stay within a few minutes on two
CPU cores, each (framework, dp) pair is one launch of `dp` gloo processes that runs all its
cases in turn: per dp, DeepSpeed saves (a), meshspeed loads (a) and saves (b), DeepSpeed
loads (b).

Writes benchmarks/results/ds_checkpoint_roundtrip.json; with --write-docs also the table
between the ds-roundtrip markers in docs/checkpoints.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from anchor_ranks import REPO, enter_rank, run_degree, spawn_ranks
from ds_checkpoint_import import (
    MORE,
    SAVE_AT,
    build_model,
    ds_config,
    ds_save_and_resume,
    ms_resume,
    rel_diff,
    train,
)

STAGES = (1, 2, 3)
DPS = (1, 2, 4)
BF16 = (2, 4)  # (stage, dp) of the one bf16 case per direction
TOLERANCE = {"fp32": 1e-5, "bf16": 2e-2}  # bf16: see Note [bf16 tolerance] below (the table's caption says both)
RESULTS = REPO / "benchmarks" / "results" / "ds_checkpoint_roundtrip.json"
DOC = REPO / "docs" / "checkpoints.md"
START, END = "<!-- ds-roundtrip:start -->", "<!-- ds-roundtrip:end -->"
COMMAND = "PYTHONPATH=. .venv/bin/python benchmarks/ds_checkpoint_roundtrip.py --write-docs"

# Note [bf16 tolerance]
# Both sides keep fp32 masters and Adam moments and both directions carry them over
# exactly, so the bf16 forward after loading sees the same weights on both sides; measured,
# the losses agree to a few 1e-7. The 2e-2 allowed for bf16 covers what may legitimately
# differ between two implementations: the order in which a bf16 matmul or reduction sums.
# One bf16 ulp is 2^-8 to 2^-7 (0.4-0.8 %) relative, so a few ulps of a changed order stay
# under 2e-2 (the tolerance tests/checkpoint/test_ds_import.py uses too).


def client_state(side: str) -> dict:
    import torch

    return {"epoch": 3, "note": f"from {side}", "offsets": torch.arange(4)}


# -- direction (b): meshspeed saves, DeepSpeed loads --------------------------------------------------
def ms_save_and_resume(rank: int, world: int, plan: dict) -> dict:
    """meshspeed trains SAVE_AT steps, saves with the DeepSpeed trail, loads its own files into a
    fresh engine and trains MORE steps."""
    import meshspeed

    cfg = {**ds_config(plan["stage"], world, plan["precision"]), "checkpoint": {"format": "deepspeed"}}
    model = build_model(0)
    engine, *_ = meshspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    before = train(engine, 0, SAVE_AT, rank, world)
    engine.save_checkpoint(plan["ckpt"], client_state=client_state("meshspeed"))
    fresh = build_model(7)
    engine2, *_ = meshspeed.initialize(model=fresh, model_parameters=fresh.parameters(), config=cfg)
    engine2.load_checkpoint(plan["ckpt"])
    return {"before": before, "after": train(engine2, SAVE_AT, SAVE_AT + MORE, rank, world)}


def ds_resume(rank: int, world: int, plan: dict) -> dict:
    """DeepSpeed loads the DeepSpeed files of plan["ckpt"] into a fresh engine and trains MORE steps."""
    import deepspeed

    cfg = ds_config(plan["stage"], world, plan["precision"])
    model = build_model(7)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    path, client = engine.load_checkpoint(plan["ckpt"])
    if path is None:  # DeepSpeed warns and returns (None, None) when it finds nothing to load
        raise RuntimeError(f"DeepSpeed found no checkpoint in {plan['ckpt']}")
    after = train(engine, SAVE_AT, SAVE_AT + MORE, rank, world)
    return {"after": after, "global_steps": engine.global_steps, "client_epoch": client.get("epoch")}


JOBS = {"ds_save": ds_save_and_resume, "ms_load": ms_resume, "ms_save": ms_save_and_resume, "ds_load": ds_resume}


def _rank(rank: int, world: int, port: int, plan: dict, out: str) -> None:
    """One launch: every case of `plan["cases"]` in turn, on one process group."""
    enter_rank(rank, world, port)
    if plan["deepspeed"]:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    results = []
    for case in plan["cases"]:
        start = time.perf_counter()
        results.append({**JOBS[case["job"]](rank, world, case), "seconds": time.perf_counter() - start})
    if rank == 0:
        Path(out).write_text(json.dumps(results))


# -- the parent -----------------------------------------------------------------------------------
def cases_at(dp: int, quick: bool) -> list[tuple[int, str]]:
    fp32 = [(stage, "fp32") for stage in (STAGES[-1:] if quick else STAGES)]
    return fp32 + ([(BF16[0], "bf16")] if dp == BF16[1] and not quick else [])


def launch(tmp: Path, dp: int, deepspeed: bool, cases: list[dict], name: str) -> list[dict]:
    work = tmp / f"run-{name}-dp{dp}"
    work.mkdir()
    start = time.perf_counter()
    got = run_degree(__file__, dp, {"deepspeed": deepspeed, "cases": cases}, work)
    print(f"  {name} at dp {dp}: {len(cases)} cases in {time.perf_counter() - start:.0f} s", flush=True)
    return got


def run_dp(tmp: Path, dp: int, quick: bool) -> list[dict]:
    """Both directions at one dp size: three launches."""
    here = cases_at(dp, quick)
    ds_dirs = {c: tmp / f"ds-z{c[0]}-dp{dp}-{c[1]}" for c in here}
    ms_dirs = {c: tmp / f"ms-z{c[0]}-dp{dp}-{c[1]}" for c in here}

    def plan(job: str, c: tuple[int, str], ckpt: Path) -> dict:
        return {"job": job, "stage": c[0], "precision": c[1], "ckpt": str(ckpt)}

    ds_ref = launch(tmp, dp, True, [plan("ds_save", c, ds_dirs[c]) for c in here], "deepspeed-save")
    ms_all = launch(tmp, dp, False, [plan("ms_load", c, ds_dirs[c]) for c in here]
                    + [plan("ms_save", c, ms_dirs[c]) for c in here], "meshspeed-load-and-save")
    ms_got, ms_ref = ms_all[:len(here)], ms_all[len(here):]
    ds_got = launch(tmp, dp, True, [plan("ds_load", c, ms_dirs[c]) for c in here], "deepspeed-load")
    rows = []
    for direction, refs, gots in (("deepspeed -> meshspeed", ds_ref, ms_got),
                                  ("meshspeed -> deepspeed", ms_ref, ds_got)):
        for (stage, precision), ref, got in zip(here, refs, gots):
            diff = rel_diff(got["after"], ref["after"])
            rows.append({"direction": direction, "zero_stage": stage, "dp": dp, "precision": precision,
                         "losses_before_save": ref["before"], "reference_losses": ref["after"],
                         "other_losses": got["after"], "max_rel_diff": diff,
                         "tolerance": TOLERANCE[precision], "within_tolerance": diff <= TOLERANCE[precision],
                         "loader_global_steps": got["global_steps"], "loader_client_epoch": got["client_epoch"]})
            print(f"{direction}: ZeRO {stage} dp {dp} {precision}: reference {fmt(ref['after'])} "
                  f"other {fmt(got['after'])} max rel {diff:.1e}", flush=True)
    return rows


def fmt(losses: list[float]) -> str:
    return ", ".join(f"{x:.7f}" for x in losses)


def git_commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(REPO), *args], check=True, capture_output=True,
                              text=True).stdout.strip()

    dirty = git("status", "--porcelain", "--", "meshspeed", "benchmarks/ds_checkpoint_import.py",
                "benchmarks/ds_checkpoint_roundtrip.py")
    return git("rev-parse", "--short=10", "HEAD") + ("+uncommitted changes" if dirty else "")


def table(result: dict) -> str:
    caption = (
        f"Measured at meshspeed commit `{result['commit']}` with DeepSpeed {result['deepspeed']} "
        f"(CPU, gloo, {result['seconds']} s in all) by `{result['command']}`: the losses of the "
        f"{MORE} steps after loading a checkpoint saved after {SAVE_AT}. The reference is the "
        "framework that saved, loading its own files; the other side loads the same files at the "
        "same dp size and ZeRO stage. Tolerance (relative): fp32 1e-5, bf16 2e-2 (Note [bf16 "
        "tolerance] in `benchmarks/ds_checkpoint_roundtrip.py`). Worst case: "
        f"{max(r['max_rel_diff'] for r in result['rows']):.1e}.")
    lines = [
        *textwrap.wrap(caption, width=90, break_long_words=False, break_on_hyphens=False),
        "",
        ("| saved by -> loaded by | ZeRO | dp | precision | reference losses after loading "
         "| other side's losses | max rel diff |"),
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(f"| {r['direction']} | {r['zero_stage']} | {r['dp']} | {r['precision']} | "
                     f"{fmt(r['reference_losses'])} | {fmt(r['other_losses'])} | {r['max_rel_diff']:.1e} |")
    return "\n".join(lines)


def write_docs(result: dict) -> None:
    text = DOC.read_text()
    if START not in text or END not in text:
        raise SystemExit(f"{DOC} has no {START} ... {END} markers to write the table between")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    DOC.write_text(f"{head}{START}\n{table(result)}\n{END}{tail}")
    print(f"wrote the table into {DOC}")


def anchor_deepspeed_version() -> str:
    from anchor_ranks import ANCHOR_PY

    return subprocess.run([str(ANCHOR_PY), "-c", "import importlib.metadata as m; print(m.version('deepspeed'))"],
                          capture_output=True, text=True, check=True).stdout.strip()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--degree", type=int, help=argparse.SUPPRESS)
    p.add_argument("--plan", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true", help="ZeRO 3 fp32 only, at each dp (no results written)")
    p.add_argument("--write-docs", action="store_true", help="also write the table into docs/checkpoints.md")
    p.add_argument("--json", default=str(RESULTS), help="where to write the rows")
    p.add_argument("--docs-from-json", action="store_true",
                   help="run nothing: write the table of the --json results into docs/checkpoints.md")
    args = p.parse_args()
    if args.worker:
        spawn_ranks(_rank, args.degree, args.plan, args.out)
        return
    if args.docs_from_json:
        write_docs(json.loads(Path(args.json).read_text()))
        return
    start = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for dp in DPS:
            rows += run_dp(Path(d), dp, args.quick)
    order = {"deepspeed -> meshspeed": 0, "meshspeed -> deepspeed": 1}
    rows.sort(key=lambda r: (order[r["direction"]], r["precision"] != "fp32", r["zero_stage"], r["dp"]))
    result = {"commit": git_commit(), "deepspeed": anchor_deepspeed_version(),
              "command": COMMAND, "seconds": round(time.perf_counter() - start), "rows": rows}
    worst = max(rows, key=lambda r: r["max_rel_diff"])
    print(f"{len(rows)} cases in {result['seconds']} s; worst max rel diff {worst['max_rel_diff']:.1e} "
          f"({worst['direction']}, ZeRO {worst['zero_stage']} dp {worst['dp']} {worst['precision']})")
    if args.quick:
        return
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    if args.write_docs:
        write_docs(result)
    if not all(r["within_tolerance"] for r in rows):
        raise SystemExit("some cases are outside the tolerance")


if __name__ == "__main__":
    main()
