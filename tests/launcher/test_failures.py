"""The report after a failed job: the earliest rank's cause last, later ranks named once."""

from __future__ import annotations

import io
import sys

from meshspeed.launcher import failures, rank_entry, remote_run


def test_records_of_the_last_restart_earliest_first(tmp_path, monkeypatch):
    times = iter([5.0, 3.0, 1.0, 4.0])
    monkeypatch.setattr(failures.time, "time", lambda: next(times))
    for rank, restart in [(0, 1), (1, 1), (0, 0), (2, 1)]:
        failures.write_record(str(tmp_path), {"RANK": str(rank), "TORCHELASTIC_RESTART_COUNT": str(restart)},
                              f"ValueError: r{rank}", "")
    (tmp_path / "stray.json").write_text("{")
    assert [(r.rank, r.restart) for r in failures.read_records(str(tmp_path))] == [(1, 1), (2, 1), (0, 1)]


def test_report_names_later_ranks_without_repeating_the_cause():
    rec = [failures.Record(2, 0, 1.0, "ValueError: bad", "Traceback (most recent call last):\n  File x\n"),
           failures.Record(0, 0, 2.0, "ValueError: bad", ""),
           failures.Record(1, 0, 2.0, "ValueError: bad", ""),
           failures.Record(3, 0, 3.0, "RuntimeError: Connection closed by peer", "")]
    lines = failures.report(rec, None)
    assert lines[-1] == "meshspeed run: rank 2 failed first: ValueError: bad"
    assert lines[-2] == ("meshspeed run: after it failed: ranks 0, 1 with the same error; "
                         "rank 3 (RuntimeError)")
    assert lines[:3] == ["meshspeed run: rank 2's traceback:", "Traceback (most recent call last):", "  File x"]
    assert sum("ValueError: bad" in line for line in lines) == 1
    assert failures.report([], (1, "exited with status 3 without a Python exception"))[-1] == \
        "meshspeed run: rank 1 failed first: exited with status 3 without a Python exception"


def test_rank_entry_records_an_uncaught_exception(tmp_path, monkeypatch, capsys):
    script = tmp_path / "s.py"
    script.write_text("import sys\nassert sys.argv[1:] == ['--x', '1']\nraise KeyError('multi\\nline')\n")
    monkeypatch.setenv(failures.ERRORS_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setattr(sys, "path", list(sys.path))
    try:
        rank_entry.main([str(script), "--x", "1"])
    except SystemExit as stop:
        assert stop.code == 1
    (record,) = failures.read_records(str(tmp_path))
    assert (record.rank, record.cause) == (3, "KeyError: 'multi\\nline'")
    assert 's.py", line 3, in <module>' in record.traceback and "runpy" not in record.traceback
    assert capsys.readouterr().err == ""  # the launcher reports it, once


def test_ssh_run_keeps_a_hosts_cause_for_the_last_line():
    printer, out = remote_run._Printer(), io.TextIOWrapper(io.BytesIO(), write_through=True)
    stream = io.BytesIO(b"[node1 r3] up\nmeshspeed run: rank 3 failed first: ValueError: bad\n")
    printer.pump(stream, out, "node1")
    assert out.buffer.getvalue() == b"[node1 r3] up\n"
    assert printer.causes == {"node1": "meshspeed run: rank 3 on node1 failed first: ValueError: bad"}


def test_a_config_error_keeps_the_users_frames_only(tmp_path, monkeypatch):
    script = tmp_path / "cfg.py"
    script.write_text("from meshspeed.config import load_config\nload_config({'train_batch_sise': 8})\n")
    monkeypatch.setenv(failures.ERRORS_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(sys, "path", list(sys.path))
    try:
        rank_entry.main([str(script)])
    except SystemExit as stop:
        assert stop.code == 1
    (record,) = failures.read_records(str(tmp_path))
    assert record.cause.startswith("ConfigError: ") and "train_batch_sise" in record.cause
    assert record.traceback.splitlines()[1].endswith('cfg.py", line 2, in <module>'), record.traceback
    assert record.traceback.rstrip().endswith("in meshspeed"), record.traceback
