"""`meshspeed run` forwards to torchrun: rank count, exit codes, argument order."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from meshspeed.launcher import launch


def meshspeed(*argv: str, tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshspeed.cli", *argv], check=False,
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()  # what meshspeed.cli does for PASSTHROUGH commands
    launch.add_arguments(parser)
    args, extra = parser.parse_known_args(argv)
    args.extra = extra
    return args


def test_two_ranks_run_and_exit_zero(tmp_path):
    script = tmp_path / "tiny.py"
    # one file per rank: two ranks printing to one pipe can interleave their bytes
    script.write_text("import os\n"
                      "r, w = os.environ['RANK'], os.environ['WORLD_SIZE']\n"
                      "open(f'rank{r}.txt', 'w').write(f'rank {r} of {w}')\n")
    result = meshspeed("run", "--nproc-per-node", "2", str(script), tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr
    seen = sorted(f.read_text() for f in tmp_path.glob("rank*.txt"))
    assert seen == ["rank 0 of 2", "rank 1 of 2"]


def test_a_failing_rank_gives_nonzero_exit(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("import os\nif os.environ['RANK'] == '1':\n    raise SystemExit(3)\n")
    result = meshspeed("run", "--nproc-per-node", "2", str(script), tmp_path=tmp_path)
    assert result.returncode != 0


def test_missing_script_is_a_usage_error(capsys):
    assert launch.main(parse([])) == 2
    assert "missing the training script" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["train.py", "--lr", "3"], ["--nproc-per-node", "1", "train.py", "--lr", "3"]),
        (["--nproc_per_node", "4", "train.py"], ["--nproc-per-node", "4", "train.py"]),
        # script options that look like ours stay with the script
        (["--nproc-per-node", "2", "train.py", "-h", "--nproc-per-node", "8"],
         ["--nproc-per-node", "2", "train.py", "-h", "--nproc-per-node", "8"]),
        # unknown torchrun options, with and without values, keep their order
        (["--master-port", "1234", "--standalone", "-m", "pkg.train", "x"],
         ["--nproc-per-node", "1", "--master-port", "1234", "--standalone", "-m", "pkg.train",
          "x"]),
        (["--nnodes=2", "--max-restarts", "3", "train.py"],
         ["--nproc-per-node", "1", "--nnodes=2", "--max-restarts", "3", "train.py"]),
    ],
)
def test_torchrun_argv_keeps_order(argv, expected, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert launch.torchrun_argv(parse(argv)) == expected
