"""benchmarks/moe.py's report on made-up timings: the paired ratios, the two targets, the
docs section (nothing is timed here; the benchmark itself runs by hand)."""

import importlib.util
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # its siblings (pipeline_worker, zero_report)
    spec = importlib.util.spec_from_file_location("moe_benchmark", BENCHMARKS / "moe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rows(bench, ep, seconds):
    parity = {"max_abs": 0.0, "max_rel": 0.0, "routing_equal": True}
    return [{"ep": ep, "experts": 8, "k": 1, "d_model": 16, "tokens": 100, "variant": name, "seconds": sec,
             "a2a_seconds": [s / 4 for s in sec], "cpu_seconds": sec, "a2a_calls": 4,
             "parity": parity if name in (bench.MS, bench.MS_DL) else None, "others": 0.1}
            for name, sec in seconds.items()]


def test_ratios_are_paired_medians_and_targets_are_judged_per_point(bench):
    rows = _rows(bench, 2, {bench.DS: [1.0, 2.0, 1.0], bench.MS: [0.9, 2.2, 0.95],
                            bench.DS_DL: [1.0, 1.0, 1.0], bench.MS_DL: [1.0, 3.0, 1.3]})
    rows += _rows(bench, 4, {bench.DS: [1.0, 1.0, 1.0], bench.MS: [1.1, 1.05, 0.9],
                             bench.DS_DL: [2.0, 2.0, 2.0], bench.MS_DL: [1.0, 1.0, 1.0]})
    low, high = bench.summarise(rows)
    assert low["ratio"] == pytest.approx(0.95)  # the median of 0.9, 1.1, 0.95: not 1.0 / 1.0
    assert high["ratio"] == pytest.approx(1.05)
    assert low["dropless_over_capacity"] == pytest.approx(3.0 / 2.2)  # pairs 1.11, 1.36, 1.37
    assert low["variants"][bench.MS]["tokens_per_s"] == pytest.approx(2 * 100 / 0.95)
    assert low["variants"][bench.MS]["a2a_share"] == pytest.approx(0.25)
    lines = bench.verdicts([low, high])
    assert "NOT met: within target at 1 of 2 points, worst 1.050x (k=1, E=8, ep=4)" in lines[0]
    assert "NOT met" in lines[3] and "ep=2 1.364x" in lines[3]
    assert "met at every point" in bench.verdicts([low])[0]


def test_the_docs_section_replaces_its_own_markers_only(bench, tmp_path):
    rows = _rows(bench, 1, {bench.DS: [1.0], bench.MS: [0.9], bench.DS_DL: [1.0], bench.MS_DL: [1.0]})
    result = {"command": "python benchmarks/moe.py", "machine": {"cpu": "test"}, "points": bench.summarise(rows),
              "plan": {"d_model": 16, "tokens": 100, "repeats": 1, "warmup": 0}}
    section = bench.markdown(result)
    assert "| 1 | 8 | 1 | 1000.0 | 900.0 | 0.90x |" in section
    assert "bit-identical at 1 of 1 points" in section
    from zero_report import replace_section

    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n<!-- other:start -->\nkept\n<!-- other:end -->\n")
    for _ in range(2):
        replace_section(section, doc, bench.DOCS_KEY)
    text = doc.read_text()
    assert text.count("<!-- moe.py:start -->") == 1 and "kept" in text
