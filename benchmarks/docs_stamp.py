"""The commit a docs figure was measured on, and the rule that no figure comes from
uncommitted code.

Every `--write-docs` goes through `replace_section` (zero_report.py), which calls
`require_committed()`: it names the commit (`git rev-parse --short HEAD`), and refuses
when tracked or untracked files outside the docs' own outputs (docs/, README.md,
benchmarks/results/) differ from it. The tree is read once, the first time this module is
asked (`begin()` at a benchmark's start): files edited while a long benchmark runs are
not what it measured. MESHSPEED_DOCS_ALLOW_DIRTY=1 writes anyway, with the commit marked
"+dirty" in the section.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUTPUTS = ("docs", "README.md", "benchmarks/results")  # what --write-docs itself rewrites
ALLOW_DIRTY = "MESHSPEED_DOCS_ALLOW_DIRTY"

_state: dict[str, object] = {}


class DirtyTree(SystemExit):
    """--write-docs on a tree with uncommitted code."""


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True,
                          check=False).stdout


def changed_files() -> list[str]:
    """Paths that differ from HEAD (untracked ones included), outside the docs' outputs."""
    excludes = [f":(exclude){p}" for p in OUTPUTS]
    out = _git("status", "--porcelain", "--", ".", *excludes)
    return [line[3:] for line in out.splitlines() if line.strip()]  # "XY path"


def begin() -> str:
    """Read the tree now (once per process): the commit the figures about to be measured
    come from, with "+dirty" when code differs from it."""
    if "commit" not in _state:
        _state["changed"] = changed_files()
        commit = _git("rev-parse", "--short", "HEAD").strip() or "unknown"
        _state["commit"] = commit + ("+dirty" if _state["changed"] else "")
    return str(_state["commit"])


def require_committed() -> str:
    """The measured commit, or raise DirtyTree naming the uncommitted files, unless
    MESHSPEED_DOCS_ALLOW_DIRTY=1 (then the commit carries "+dirty")."""
    commit = begin()
    changed = _state["changed"]
    if changed and os.environ.get(ALLOW_DIRTY) != "1":
        shown = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
        raise DirtyTree(f"--write-docs refused: the working tree has uncommitted changes ({shown}), and a "
                        f"docs figure must come from a commit; commit them (or set {ALLOW_DIRTY}=1 to write "
                        f"the section marked {commit})")
    return commit


def stamp_line(commit: str) -> str:
    """The line every written section carries."""
    warn = " **(uncommitted code: not a figure to keep)**" if commit.endswith("+dirty") else ""
    return f"Measured at commit `{commit}`{warn}."
