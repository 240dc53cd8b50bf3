"""`benchmarks/infinity.py --write-docs`: one world size's row of the 2B ZeRO-Infinity table in
docs/benchmarks.md (between `<!-- infinity:start -->` and `<!-- infinity:end -->`), and the
run's summary in benchmarks/results/infinity-2b-w<W>.json.

The table has one row per world size; a run replaces its own row (the line that starts
with `| W |`) and leaves the other, so each row names the commit it was measured on.
"""

from __future__ import annotations

import json
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "benchmarks.md"
START, END = "<!-- infinity:start -->", "<!-- infinity:end -->"
PARAMS = 1.999e9  # the table's model: the reference GPT at --params 2e9


def results_path(world: int) -> Path:
    return REPO / "benchmarks" / "results" / f"infinity-2b-w{world}.json"


def row(s: dict) -> str:
    """The markdown row of one run's summary (what infinity.py prints as JSON, plus "commit")."""
    io, c = s["io_gb_per_step"], s.get("checkpoint")
    ckpt = "not run"
    if c:
        same = "equal" if c["equal"] else f"NOT equal: {c['loss_resumed']:.4f} resumed"
        ckpt = (f"{c['bytes'] / 1e9:.1f} GB saved in {c['save_s']:.1f} s, loaded by a fresh engine in "
                f"{c['load_s']:.1f} s; the next step's loss {same} ({c['loss_continued']:.4f})")
    return (f"| {s['world']} | `{s['commit']}` | {' / '.join(f'{x:.2f}' for x in s['peak_rss_per_rank_gib'])} GiB | "
            f"{', '.join(f'{x:.3f}' for x in s['losses'])} | {s['median_step_s']:.1f} s | "
            f"{s['io_bound_s']:.1f} s ({io['read']:.1f} GB read, {io['write']:.1f} GB written) | "
            f"{s['compute_bound_s']:.1f} s | {s['step_over_bound']:.2f}x | {ckpt} |")


def write(summary: dict, doc: Path = DOC) -> None:
    """Save the summary and replace its world size's row of the table."""
    if abs(summary["params"] - PARAMS) > 0.01e9:
        raise SystemExit(f"--write-docs fills the 2B table's row, but this model has {summary['params'] / 1e9:.3f}B "
                         "parameters; run with --params 2e9")
    results_path(summary["world"]).write_text(json.dumps(summary, indent=1, default=str) + "\n")
    text = doc.read_text()
    if START not in text or END not in text:
        raise SystemExit(f"{doc} has no {START} ... {END} section to write the row into")
    head, rest = text.split(START, 1)
    body, tail = rest.split(END, 1)
    lines = body.split("\n")
    key = f"| {summary['world']} |"
    at = [i for i, line in enumerate(lines) if line.startswith(key)]
    if not at:
        raise SystemExit(f"the table in {doc}'s infinity section has no row for world {summary['world']} "
                         f"(a line starting {key!r}) to replace")
    lines[at[0]] = row(summary)
    doc.write_text(head + START + "\n".join(lines) + END + tail)
