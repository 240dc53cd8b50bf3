"""The record of a search: one row per trial, as a printed table, summary.md and JSON."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# what "better" means for each autotuning.metric: (Trial attribute, larger is better)
METRICS = {"throughput": ("samples_per_second", True), "latency": ("step_seconds", False),
           "flops": ("flops_per_second", True)}


@dataclass
class Trial:
    name: str  # exps_dir/<name>/ holds its config, log and metrics
    layout: str  # the planner's label, e.g. dp2-zero1-mb2x2
    keys: dict[str, Any]  # the config keys this layout sets (space.layout_keys)
    predicted_step_seconds: float
    predicted_memory_bytes: float
    status: str = "pending"  # ok | failed | skipped (early stopping)
    reason: str = ""
    step_seconds: float | None = None
    samples_per_second: float | None = None
    tokens_per_second: float | None = None
    flops_per_second: float | None = None
    peak_memory_bytes: int | None = None
    step_times: list[float] = field(default_factory=list)  # rank 0's timed steps, one by one
    config: dict[str, Any] = field(default_factory=dict, repr=False)

    def score(self, metric: str) -> float | None:
        attr, larger = METRICS[metric]
        value = getattr(self, attr)
        return None if value is None else (value if larger else -value)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def _num(x: float | None, scale: float = 1.0, fmt: str = "{:.1f}") -> str:
    return "-" if x is None else fmt.format(x / scale)


def table(trials: list[Trial], best: Trial | None) -> str:
    head = ("| # | layout | predicted ms/step | measured ms/step | samples/s | tokens/s | "
            "peak MB | status |\n|---|---|---|---|---|---|---|---|")
    rows = []
    for i, t in enumerate(trials):
        status = t.status + (f": {t.reason}" if t.reason else "") + (" (best)" if t is best else "")
        rows.append(f"| {i + 1} | {t.layout} | {_ms(t.predicted_step_seconds)} | {_ms(t.step_seconds)} | "
                    f"{_num(t.samples_per_second)} | {_num(t.tokens_per_second, fmt='{:.0f}')} | "
                    f"{_num(t.peak_memory_bytes, 2**20)} | {status.replace('|', '/')} |")
    return "\n".join([head, *rows])


def write(results: Path, trials: list[Trial], best: Trial | None, metric: str, facts: dict,
          noise: str = "") -> str:
    """`noise`: pick.py's sentence when the top trials are within noise of each other."""
    text = table(trials, best)
    if best is None:
        verdict = "No trial finished; no best_config.json was written."
    elif noise:
        verdict = f"Kept **{best.layout}** (best_config.json); the top trials are {noise}."
    else:
        verdict = f"Fastest by {metric}: **{best.layout}** (best_config.json)."
    (results / "summary.md").write_text(f"# meshspeed autotune\n\n{verdict}\n\n{text}\n")
    data = {"metric": metric, "best": best.name if best else None, "within_noise": noise or None, "model": facts,
            "trials": [{k: v for k, v in asdict(t).items() if k != "config"} for t in trials]}
    (results / "summary.json").write_text(json.dumps(data, indent=2) + "\n")
    return f"{text}\n\n{verdict}"
