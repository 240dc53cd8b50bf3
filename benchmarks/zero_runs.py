"""The targets of several `benchmarks/zero.py --json` runs side by side, one column per run
(what docs/benchmarks.md's issue-36 table shows):

    .venv/bin/python benchmarks/zero_runs.py benchmarks/results/zero-default-fp32-2-issue36-run*.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(paths: list[str]) -> None:
    runs = [json.loads(Path(p).read_text()) for p in paths]
    heads = [f"run {i + 1} ({r['machine']['meshspeed commit']})" for i, r in enumerate(runs)]
    print("| target (paired per-round ratio; wall clock / CPU time) | " + " | ".join(heads) + " |")
    print("|---|" + "---|" * len(runs))
    for i, target in enumerate(runs[0]["targets_wall"]):
        if "model state" in target["target"] or "RSS" in target["target"]:
            continue
        cells = []
        for r in runs:
            wall, cpu = r["targets_wall"][i], r["targets_cpu"][i]
            cells.append(f"{wall['measured']} {wall['verdict']} / {cpu['measured']} {cpu['verdict']}")
        print(f"| {target['target']} | " + " | ".join(cells) + " |")
    loads = ["max other load " + f"{100 * max(v['other_load'] for v in r['results'].values()):.0f}%" for r in runs]
    print("| (machine) | " + " | ".join(loads) + " |")


if __name__ == "__main__":
    if not sys.argv[1:] or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if sys.argv[1:] else 2)
    main(sys.argv[1:])
