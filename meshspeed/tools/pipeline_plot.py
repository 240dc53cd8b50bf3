"""`meshspeed pipeline-plot`: a pipeline schedule as executed, drawn as a Gantt chart (PNG).

    meshspeed pipeline-plot --timeline zb-h1-p2-m8.json -o zb.png      # a recorded run
    meshspeed pipeline-plot --schedule 1f1b --stages 2 --micro-batches 8 -o 1f1b.png
    meshspeed pipeline-plot --schedule zb-h1 --stages 4 --micro-batches 8 --simulated -o plan.png

One row per stage, one box per executed action: forward (F), whole backward (B), input
half (I) and weight half (W) of a split backward, each in its own colour, with the micro-
batch in the box (`3.1`: micro-batch 3 on model chunk 1); the grey left between boxes is
idle. The title names the schedule, p, m (and v) and the bubble of what is drawn
(`timeline.bubble_fraction`).

`--timeline FILE` reads what `json.dump(to_json(engine.gather_timeline()), f)` wrote
(`benchmarks/pipeline.py --timeline-dir` writes one per configuration); a dict with that
list under "timeline" and optional "schedule" is read too. Without it, the command runs a
small real pipeline itself: `--stages` gloo ranks on this machine train a tiny GPTPipe for
`--batches` batches under `--schedule` and the last batch's timeline is drawn. `--simulated`
draws `schedule.simulate`'s timeline instead, the planned schedule: with --timeline, of
that run's schedule and its median pass times; otherwise with t_F = 1, t_B = 2 (t_W = 1).

matplotlib is an optional dependency (`pip install meshspeed[plots]`), imported only to
draw.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

import meshspeed
from meshspeed.models.gpt import GPTConfig
from meshspeed.models.gpt_pipe import GPTPipe
from meshspeed.parallel.pipeline.schedule import SCHEDULES, ScheduleError, build, simulate
from meshspeed.parallel.pipeline.timeline import Span, bubble_fraction, from_json, from_simulation
from meshspeed.testing import run_distributed

COLOURS = {"F": "#4c72b0", "B": "#55a868", "I": "#dd8452", "W": "#8172b2"}
NAMES = {"F": "forward", "B": "backward", "I": "input grad (I)", "W": "weight grad (W)"}
IDLE = "#e6e6e6"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class PlotError(ValueError):
    """A timeline that cannot be read or drawn, or a run that cannot be made."""


# -- reading -------------------------------------------------------------------------------------


def load_timeline(path: str | Path) -> tuple[list[list[Span]], str | None]:
    """(spans per stage, the schedule's name if the file says it) from a JSON file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise PlotError(f"cannot read the timeline {str(path)!r} ({err.strerror or err}); pass the JSON "
                        "file that to_json(engine.gather_timeline()) was dumped to") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise PlotError(f"the timeline {str(path)!r} is not JSON (line {err.lineno}, column {err.colno}: "
                        f"{err.msg}); pass what json.dump(to_json(engine.gather_timeline()), f) wrote") from None
    name = None
    if isinstance(data, dict):
        name = data.get("schedule")
        data = data.get("timeline")
    if not isinstance(data, list) or not data or not all(isinstance(row, list) for row in data):
        raise PlotError(f"the timeline {str(path)!r} must be a non-empty list with one list of spans per "
                        f"stage (what to_json(engine.gather_timeline()) returns), got {type(data).__name__}")
    try:
        spans = from_json(data)
    except ValueError as err:
        raise PlotError(f"the timeline {str(path)!r}: {err}") from None
    if not any(spans):
        raise PlotError(f"the timeline {str(path)!r} has no spans: record a batch with "
                        "engine.record_timeline = True before train_batch")
    bad = sorted({s.kind for row in spans for s in row} - set(COLOURS))
    if bad:
        raise PlotError(f"the timeline {str(path)!r} has spans of kind {', '.join(map(repr, bad))}; "
                        f"a span's kind is one of {', '.join(COLOURS)}")
    return spans, name


def describe(spans: Sequence[Sequence[Span]]) -> dict:
    """p, m, v and the schedule's likely name, read off the spans: I/W passes mean zb-h1,
    chunks above 0 interleaved, every forward of every stage before its first backward
    GPipe, else 1F1B."""
    every = [s for row in spans for s in row]
    kinds = {s.kind for s in every}
    v = 1 + max(s.chunk for s in every)
    if kinds & {"I", "W"}:
        name = "zb-h1"
    elif v > 1:
        name = "interleaved"
    else:
        def forwards_first(row):
            kinds_in_order = [s.kind for s in sorted(row, key=lambda s: s.start)]
            return "B" not in kinds_in_order or "F" not in kinds_in_order[kinds_in_order.index("B"):]
        name = "gpipe" if all(forwards_first(row) for row in spans) else "1f1b"
    return {"schedule": name, "stages": len(spans), "micro_batches": 1 + max(s.micro for s in every),
            "virtual_stages": v}


def pass_times(spans: Sequence[Sequence[Span]]) -> dict[str, float]:
    """The median length of each kind of span over every stage."""
    out = {}
    for kind in COLOURS:
        ts = [s.end - s.start for row in spans for s in row if s.kind == kind]
        if ts:
            out[kind] = statistics.median(ts)
    return out


def simulated_spans(schedule: str, stages: int, micro_batches: int, virtual_stages: int = 1,
                    times: dict[str, float] | None = None) -> list[list[Span]]:
    """`simulate`'s spans of the schedule, with `times` (median pass times of a run, a chunk's
    for interleaved) or t_F = 1, t_B = 2, t_W = 1."""
    plan = build(schedule, micro_batches, stages, virtual_stages)
    v = virtual_stages
    if times:
        t_f = times["F"] * v
        t_b = (times["I"] + times["W"] if "I" in times else times["B"]) * v
        t_w = times.get("W")
    else:
        t_f, t_b, t_w = 1.0, 2.0, (1.0 if schedule == "zb-h1" else None)
    return from_simulation(simulate(plan, t_forward=t_f, t_backward=t_b, t_weight=t_w, virtual_stages=v).spans)


# -- drawing -------------------------------------------------------------------------------------


def _figure_class():
    try:
        # lazy: optional dependency (the plots extra)
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure  # lazy: optional dependency
        from matplotlib.patches import Patch  # lazy: optional dependency
    except ImportError:
        raise PlotError("drawing a pipeline timeline needs matplotlib, which is not installed: "
                        "pip install meshspeed[plots]") from None
    return Figure, FigureCanvasAgg, Patch


def draw(spans: Sequence[Sequence[Span]], output: str | Path, *, title: str, unit: str = "ms") -> Path:
    """Write a Gantt chart of `spans` (one row per stage) to the PNG `output`. `unit` "ms"
    shows seconds as milliseconds; anything else is drawn as it is (simulated time)."""
    Figure, Canvas, Patch = _figure_class()
    scale = 1e3 if unit == "ms" else 1.0
    origin = min(s.start for row in spans for s in row)
    end = max(s.end for row in spans for s in row)
    span_len = (end - origin) * scale
    p = len(spans)
    fig = Figure(figsize=(12, 1.6 + 0.5 * p), dpi=120)
    Canvas(fig)
    ax = fig.add_subplot(1, 1, 1)
    chunks = 1 + max(s.chunk for row in spans for s in row)
    for stage, row in enumerate(spans):
        ax.barh(stage, span_len, left=0, height=0.8, color=IDLE, edgecolor="none")
        for s in row:
            left, width = (s.start - origin) * scale, (s.end - s.start) * scale
            alpha = 1.0 - 0.45 * s.chunk / max(chunks - 1, 1) if chunks > 1 else 1.0
            ax.barh(stage, width, left=left, height=0.8, color=COLOURS[s.kind], alpha=alpha,
                    edgecolor="white", linewidth=0.6)
            if width >= span_len / 160:
                label = f"{s.micro}.{s.chunk}" if chunks > 1 else str(s.micro)
                ax.text(left + width / 2, stage, label, ha="center", va="center", color="white",
                        fontsize=7 if width >= span_len / 80 else 5, clip_on=True)
    ax.set_yticks(range(p))
    ax.set_yticklabels([f"stage {s}" for s in range(p)])
    ax.set_ylim(p - 0.4, -0.6)
    ax.set_xlim(0, span_len)
    ax.set_xlabel("time (ms)" if unit == "ms" else f"time ({unit})")
    ax.set_title(title, fontsize=10)
    present = [k for k in COLOURS if any(s.kind == k for row in spans for s in row)]
    handles = [Patch(color=COLOURS[k], label=NAMES[k]) for k in present] + [Patch(color=IDLE, label="idle")]
    if chunks > 1:
        handles.append(Patch(color=COLOURS["F"], alpha=0.55, label=f"paler: a later chunk (micro.chunk, {chunks} chunks)"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.25 - 0.3 / p),
              ncol=len(handles), fontsize=8, frameon=False)
    fig.tight_layout()
    output = Path(output)
    fig.savefig(output, format="png", bbox_inches="tight")
    return output


def title_for(info: dict, bubble: float, simulated: bool) -> str:
    v = info["virtual_stages"]
    head = f"{info['schedule']}, p={info['stages']}, m={info['micro_batches']}" + (f", v={v}" if v > 1 else "")
    what = "simulated (planned)" if simulated else "measured"
    return f"{head}: {what} bubble {bubble:.1%}"


# -- a small real run ----------------------------------------------------------------------------


def _plot_rank(schedule: str, micro_batches: int, virtual_stages: int, batches: int) -> list:
    """On each of `stages` ranks: train a tiny GPTPipe and return the last batch's timeline
    (plain tuples, every rank the same)."""
    torch.set_num_threads(1)
    p = torch.distributed.get_world_size()
    cfg = GPTConfig(vocab_size=64, max_seq_len=32, n_layer=2 * p * virtual_stages, n_head=2, d_model=128)
    torch.manual_seed(0)
    net = GPTPipe(cfg, num_stages=p, virtual_stages=virtual_stages)
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": micro_batches,
              "optimizer": {"type": "SGD", "params": {"lr": 1e-3}}, "pipeline": {"schedule": schedule}}
    engine, *_ = meshspeed.initialize(model=net, model_parameters=net.parameters(), config=config)
    engine.record_timeline = True
    g = torch.Generator().manual_seed(0)
    for _ in range(batches):
        tokens = torch.randint(0, cfg.vocab_size, (micro_batches, 4, 33), generator=g)
        engine.train_batch(iter([(t[:, :-1], t[:, 1:]) for t in tokens]))
    return [[tuple(s) for s in row] for row in engine.gather_timeline()]


def record_run(schedule: str, stages: int, micro_batches: int, virtual_stages: int = 1,
               batches: int = 2, timeout: float = 300.0) -> list[list[Span]]:
    """Run `schedule` for real on `stages` gloo ranks of this machine (a tiny GPTPipe) and
    return the spans of its last batch."""
    try:
        build(schedule, micro_batches, stages, virtual_stages)
    except ScheduleError as err:
        raise PlotError(f"--schedule {schedule} --stages {stages} --micro-batches {micro_batches}"
                        f"{f' --virtual-stages {virtual_stages}' if virtual_stages > 1 else ''}: {err}") from None
    if stages < 2:
        raise PlotError(f"--stages {stages}: a pipeline run needs at least 2 stages")
    if batches < 1:
        raise PlotError(f"--batches {batches}: run at least 1 batch")
    rows = run_distributed(_plot_rank, world_size=stages, args=(schedule, micro_batches, virtual_stages, batches),
                           timeout=timeout)[0]
    return [[Span(*s) for s in row] for row in rows]


# -- the command ---------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--timeline", metavar="FILE",
                        help="JSON of to_json(engine.gather_timeline()) to draw (default: make a real run)")
    parser.add_argument("--schedule", choices=list(SCHEDULES),
                        help="the schedule to run or simulate (with --timeline: only names it in the title)")
    parser.add_argument("--stages", type=int, default=2, help="p, pipeline stages (default 2)")
    parser.add_argument("--micro-batches", type=int, default=8, help="m, micro-batches a batch (default 8)")
    parser.add_argument("--virtual-stages", type=int, default=None,
                        help="v, model chunks per stage (interleaved only; default 2 there, else 1)")
    parser.add_argument("--batches", type=int, default=2, help="batches of the real run; the last is drawn")
    parser.add_argument("--simulated", action="store_true",
                        help="draw schedule.simulate's planned timeline instead of an executed one")
    parser.add_argument("-o", "--output", default="pipeline.png", help="the PNG to write (default pipeline.png)")


def main(args: argparse.Namespace) -> int:
    try:
        if args.timeline:
            spans, named = load_timeline(args.timeline)
            info = describe(spans)
            info["schedule"] = args.schedule or named or info["schedule"]
            if args.simulated:
                spans = simulated_spans(info["schedule"], info["stages"], info["micro_batches"],
                                        info["virtual_stages"], pass_times(spans))
        else:
            if args.schedule is None:
                raise PlotError("give --timeline FILE, or --schedule (with --stages and --micro-batches) "
                                "to run or --simulated to plan one")
            v = args.virtual_stages or (2 if args.schedule == "interleaved" else 1)
            info = {"schedule": args.schedule, "stages": args.stages, "micro_batches": args.micro_batches,
                    "virtual_stages": v}
            if args.simulated:
                try:
                    spans = simulated_spans(args.schedule, args.stages, args.micro_batches, v)
                except ScheduleError as err:
                    raise PlotError(f"--schedule {args.schedule}: {err}") from None
            else:
                spans = record_run(args.schedule, args.stages, args.micro_batches, v, args.batches)
        unit = "ms" if args.timeline or not args.simulated else "t_F units"
        bubble = bubble_fraction(spans)
        out = draw(spans, args.output, title=title_for(info, bubble, args.simulated), unit=unit)
    except PlotError as err:
        print(f"meshspeed pipeline-plot: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({info['schedule']}, p={info['stages']}, m={info['micro_batches']}, "
          f"{'simulated' if args.simulated else 'measured'} bubble {bubble:.1%})")
    return 0
