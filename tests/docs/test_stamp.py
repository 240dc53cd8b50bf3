"""`--write-docs` names the commit it measured and refuses uncommitted code
(benchmarks/docs_stamp.py), in a scratch git repository."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def stamp(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import docs_stamp  # lazy: benchmarks/ is on sys.path only inside this fixture

    repo = tmp_path / "repo"
    (repo / "docs").mkdir(parents=True)
    (repo / "code.py").write_text("x = 1\n")
    (repo / "docs" / "b.md").write_text("table\n")
    _git(repo, "init", "-q")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "add", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    monkeypatch.setattr(docs_stamp, "REPO", repo)
    monkeypatch.setattr(docs_stamp, "_state", {})
    monkeypatch.delenv(docs_stamp.ALLOW_DIRTY, raising=False)
    return docs_stamp, repo


def test_a_clean_tree_gives_its_commit_and_docs_edits_do_not_count(stamp):
    docs_stamp, repo = stamp
    (repo / "docs" / "b.md").write_text("a new table\n")  # what --write-docs itself rewrites
    assert docs_stamp.require_committed() == _git(repo, "rev-parse", "--short", "HEAD")


def test_uncommitted_code_is_refused_or_marked(stamp, monkeypatch):
    docs_stamp, repo = stamp
    (repo / "code.py").write_text("x = 2\n")
    (repo / "new.py").write_text("")
    with pytest.raises(docs_stamp.DirtyTree, match=r"uncommitted changes \(code.py, new.py\)"):
        docs_stamp.require_committed()
    monkeypatch.setenv(docs_stamp.ALLOW_DIRTY, "1")
    commit = docs_stamp.require_committed()
    assert commit.endswith("+dirty") and "not a figure to keep" in docs_stamp.stamp_line(commit)


def test_the_tree_is_read_once_at_the_start(stamp):
    docs_stamp, repo = stamp
    first = docs_stamp.begin()
    (repo / "code.py").write_text("x = 3\n")  # edited while a benchmark runs
    assert docs_stamp.require_committed() == first
