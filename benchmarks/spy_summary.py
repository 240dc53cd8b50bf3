"""Summarise a py-spy raw profile of benchmarks/step_faults.py (`py-spy record --native -f raw`):
share of the timed loop's samples by leaf frame (MKL sgemm, elementwise kernels, ...) and by
the deepest meshspeed Python frame.

    .venv/bin/python benchmarks/spy_summary.py spy.txt [more.txt ...]
"""

from __future__ import annotations

import collections
import re
import sys

LOOP = "timed_steps (step_faults.py"


def load(path: str) -> list[tuple[list[str], int]]:
    rows = []
    with open(path) as f:
        for line in f:
            stack, _, n = line.rstrip().rpartition(" ")
            rows.append((stack.split(";"), int(n)))
    return [(s, n) for s, n in rows if any(LOOP in frame for frame in s)]


def summarise(path: str, top: int = 8) -> None:
    rows = load(path)
    total = sum(n for _, n in rows) or 1
    leaf, owner = collections.Counter(), collections.Counter()
    for stack, n in rows:
        leaf[re.sub(r"\s*\(.*\)$", "", stack[-1])[:90]] += n
        ours = [f for f in stack if ".py:" in f and "meshspeed/" in f]
        owner[re.sub(r":\d+\)", ")", ours[-1]) if ours else "(no meshspeed frame)"] += n
    print(f"{path}: {total} samples in the timed loop")
    for title, counts in (("leaf frame", leaf), ("deepest meshspeed frame", owner)):
        print(f"  by {title}:")
        for name, n in counts.most_common(top):
            print(f"    {100 * n / total:5.1f}%  {name}")


if __name__ == "__main__":
    if not sys.argv[1:] or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if sys.argv[1:] else 2)
    for p in sys.argv[1:]:
        summarise(p)
