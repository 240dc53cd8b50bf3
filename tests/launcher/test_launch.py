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
    # no exception to report: how the rank ended, from torchrun
    assert result.stderr.splitlines()[-1] == ("meshspeed run: rank 1 failed first: exited with status 3 "
                                              "without a Python exception"), result.stderr


def test_the_first_failing_ranks_cause_is_the_last_line_once(tmp_path):
    script = tmp_path / "raises.py"
    cause = "tensor_parallel.autotp_size 3 needs a multiple of 3 processes; launch a multiple of 3 processes (now 2)"
    script.write_text(f"import os, time\nCAUSE = {cause!r}\n"  # not on a traceback's source line
                      "def build():\n"
                      "    raise ValueError(CAUSE)\n"
                      "if os.environ['RANK'] == '1':\n"
                      "    build()\n"
                      "time.sleep(30)\n")  # rank 0 is stopped by torchrun, not failed by itself
    result = meshspeed("run", "--nproc-per-node", "2", str(script), tmp_path=tmp_path)
    assert result.returncode == 1
    out = result.stdout + result.stderr
    assert result.stderr.splitlines()[-1] == f"meshspeed run: rank 1 failed first: ValueError: {cause}", out
    assert out.count(cause) == 1, out
    assert "ChildFailedError" not in out and "Root Cause" not in out, out
    # the script's frames are shown (not the launcher's or runpy's)
    assert 'raises.py", line 6, in <module>' in result.stderr and "runpy" not in result.stderr, out


def test_missing_script_is_a_usage_error(capsys):
    assert launch.main(parse([])) == 2
    assert "missing the training script" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["nosuch.py"], "meshspeed run: the script nosuch.py does not exist"),
        (["--deepspeed-compat", "nosuch.py", "--deepspeed"], "meshspeed run: the script nosuch.py does not exist"),
        (["-m", "nosuch_pkg.train"], "meshspeed run: no module named 'nosuch_pkg' (from -m nosuch_pkg.train)"),
        (["--no-python", "nosuch_program"], "meshspeed run: the program nosuch_program is not an executable file"),
    ],
)
def test_a_missing_target_is_found_before_any_process_starts(argv, expected, capsys, monkeypatch):
    started = []
    monkeypatch.setattr(launch, "torchrun_main", started.append)
    assert launch.main(parse(argv)) == 2
    err = capsys.readouterr().err
    assert err.startswith(expected) and err.count("\n") == 1, err
    assert started == []


def test_each_rank_starts_under_rank_entry():
    entry = ["-m", "meshspeed.launcher.rank_entry"]
    assert launch.with_rank_entry(["--nproc-per-node", "2", "t.py", "-m", "x"]) == \
        ["--nproc-per-node", "2", *entry, "t.py", "-m", "x"]
    assert launch.with_rank_entry(["--nproc-per-node", "2", "-m", "pkg.train", "x"]) == \
        ["--nproc-per-node", "2", *entry, "-m", "pkg.train", "x"]
    # --deepspeed-compat's child is itself a module; --no-python programs are not Python
    assert launch.with_rank_entry(["--nproc-per-node", "1", "-m", "meshspeed.compat.child", "t.py"]) == \
        ["--nproc-per-node", "1", *entry, "-m", "meshspeed.compat.child", "t.py"]
    assert launch.with_rank_entry(["--nproc-per-node", "1", "--no-python", "echo", "hi"]) == \
        ["--nproc-per-node", "1", "--no-python", "echo", "hi"]


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
