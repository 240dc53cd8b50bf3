"""`meshspeed pipeline-plot` (meshspeed/tools/pipeline_plot.py): a recorded timeline's
JSON drawn as a PNG, clear errors for files that are not one, the simulated (planned)
schedule, and a real two-stage run drawn end to end."""

import importlib.util
import json
import sys

import pytest

from meshspeed.cli import main as cli_main
from meshspeed.parallel.pipeline.schedule import build, simulate
from meshspeed.parallel.pipeline.timeline import Span, from_simulation, to_json
from meshspeed.tools import pipeline_plot as plot

needs_matplotlib = pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None,
    reason="matplotlib is not installed (the optional `plots` extra: pip install meshspeed[plots])")


def _is_png(path):
    data = path.read_bytes()
    return len(data) > 0 and data[:8] == plot.PNG_MAGIC


def _zb_timeline(tmp_path):
    spans = from_simulation(simulate(build("zb-h1", 4, 2), t_weight=1.0).spans)
    path = tmp_path / "zb.json"
    path.write_text(json.dumps(to_json([[Span(s.kind, s.micro, s.chunk, s.start / 100, s.end / 100)
                                          for s in row] for row in spans])))
    return path


@needs_matplotlib
def test_a_timeline_file_becomes_a_png(tmp_path, capsys):
    out = tmp_path / "zb.png"
    assert cli_main(["pipeline-plot", "--timeline", str(_zb_timeline(tmp_path)), "-o", str(out)]) == 0
    assert _is_png(out)
    said = capsys.readouterr().out
    assert "zb-h1, p=2, m=4" in said and "measured bubble" in said


@needs_matplotlib
def test_a_timeline_in_a_dict_with_its_schedule_and_the_simulated_plan_of_a_file(tmp_path):
    spans = from_simulation(simulate(build("gpipe", 4, 2)).spans)
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"schedule": "gpipe", "timeline": to_json(spans)}))
    assert plot.load_timeline(path)[1] == "gpipe"
    assert plot.describe(plot.load_timeline(path)[0])["schedule"] == "gpipe"
    out = tmp_path / "plan.png"
    assert cli_main(["pipeline-plot", "--timeline", str(path), "--simulated", "-o", str(out)]) == 0
    assert _is_png(out)


@pytest.mark.parametrize("name,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)])
def test_the_schedule_is_read_off_the_spans(name, v):
    spans = from_simulation(simulate(build(name, 8, 4, v), t_weight=1.0 if name == "zb-h1" else None,
                                     virtual_stages=v).spans)
    assert plot.describe(spans) == {"schedule": name, "stages": 4, "micro_batches": 8, "virtual_stages": v}


def test_bad_timeline_files_are_named(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("[[{\"kind\": \"F\",")
    assert cli_main(["pipeline-plot", "--timeline", str(bad), "-o", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert "is not JSON (line 1" in err and "to_json(engine.gather_timeline())" in err
    assert not (tmp_path / "x.png").exists()
    cases = {
        "[]": "non-empty list with one list of spans per stage",
        "{\"spans\": []}": "non-empty list with one list of spans per stage",
        "[[{\"kind\": \"F\", \"micro\": 0}]]": "objects with kind, micro, chunk, start and end",
        "[[], []]": "has no spans",
        "[[{\"kind\": \"X\", \"micro\": 0, \"chunk\": 0, \"start\": 0, \"end\": 1}]]": "kind 'X'",
    }
    for text, message in cases.items():
        bad.write_text(text)
        with pytest.raises(plot.PlotError, match=message):
            plot.load_timeline(bad)
    with pytest.raises(plot.PlotError, match="cannot read the timeline"):
        plot.load_timeline(tmp_path / "missing.json")


def test_no_input_and_a_schedule_that_cannot_run_are_named(capsys):
    assert cli_main(["pipeline-plot"]) == 2
    assert "give --timeline FILE, or --schedule" in capsys.readouterr().err
    assert cli_main(["pipeline-plot", "--schedule", "interleaved", "--stages", "4", "--micro-batches", "6"]) == 2
    assert "multiples of the 4 stages" in capsys.readouterr().err


def test_without_matplotlib_the_error_says_how_to_install_it(tmp_path, monkeypatch, capsys):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    out = tmp_path / "zb.png"
    assert cli_main(["pipeline-plot", "--timeline", str(_zb_timeline(tmp_path)), "-o", str(out)]) == 2
    assert "pip install meshspeed[plots]" in capsys.readouterr().err
    assert not out.exists()


@needs_matplotlib
def test_the_simulated_schedule_is_drawn(tmp_path, capsys):
    out = tmp_path / "plan.png"
    assert cli_main(["pipeline-plot", "--schedule", "interleaved", "--stages", "4", "--micro-batches", "8",
                     "--simulated", "-o", str(out)]) == 0
    assert _is_png(out)
    assert "simulated bubble 15.8%" in capsys.readouterr().out  # 3 / (2 * 8 + 3)


@needs_matplotlib
def test_a_real_two_stage_run_is_drawn(tmp_path, capsys):
    out = tmp_path / "run.png"
    assert cli_main(["pipeline-plot", "--schedule", "1f1b", "--stages", "2", "--micro-batches", "4",
                     "-o", str(out)]) == 0
    assert _is_png(out)
    assert "1f1b, p=2, m=4, measured bubble" in capsys.readouterr().out
    spans = plot.record_run("zb-h1", 2, 4, batches=1)
    # stage 0 runs each W right after its I: one B (Note [an I right before its W is a B])
    assert [sorted((s.kind, s.micro) for s in row) for row in spans] == [
        sorted([(k, i) for k in "FB" for i in range(4)]), sorted([(k, i) for k in "FIW" for i in range(4)])]
