"""`meshspeed aio-bench`: runs, reports both sides, writes only its own docs section."""

from meshspeed.cli import main


def test_aio_bench_reports_and_writes_its_section(tmp_path, capsys):
    report = tmp_path / "benchmarks.md"
    other = "<!-- zero.py:start -->\nZeRO numbers\n<!-- zero.py:end -->\n"
    report.write_text("# Benchmarks\n\n" + other)
    argv = ["aio-bench", "--path", str(tmp_path), "--size-mb", "4", "--request-mb", "1",
            "--thread-count", "1", "2", "--repeats", "1", "--report", str(report)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "baseline (os.write / os.readv, 1 thread)" in out and "swap engine, 2 thread(s)" in out
    assert main(argv + ["--buffered"]) == 0  # rewrites its section, does not append another
    text = report.read_text()
    assert other in text and text.count("<!-- aio-bench:start -->") == 1
    assert "page cache" in text
    assert [p.name for p in tmp_path.iterdir()] == ["benchmarks.md"]  # scratch files removed


def test_aio_bench_refuses_a_missing_directory(tmp_path):
    assert main(["aio-bench", "--path", str(tmp_path / "nope")]) == 2
