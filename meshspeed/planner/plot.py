"""A PNG of a Plan: memory per rank (stacked by part) and step time (stacked by part) for
the fastest layouts. matplotlib is optional: without it, a clear error."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from meshspeed.planner.plan import Plan

MEMORY_PARTS = ("params", "grads", "optimizer", "activations", "buffers", "headroom")
TIME_PARTS = ("compute", "bubble", "tp", "cp", "ep", "pp", "dp", "offload")


def plot_plan(plan: Plan, path: str | Path, top: int = 8) -> None:
    fig = figure(plan, top)
    fig.savefig(path, dpi=100, bbox_inches="tight")  # the legends below are kept whole


def figure(plan: Plan, top: int = 8):
    """The matplotlib Figure plot_plan saves: memory and step time, a legend under each."""
    try:
        import matplotlib  # lazy: optional dependency (plots extra)

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # lazy: optional dependency (plots extra)
    except ImportError:
        raise RuntimeError("--plot needs matplotlib, which is not installed; "
                           "pip install matplotlib, or drop --plot") from None
    choices = plan.candidates[:top]
    if not choices:
        raise ValueError("nothing to plot: no layout fits")
    labels = [ch.candidate.label().replace(" mb", "\nmb") for ch in choices]
    fig, (ax_m, ax_t) = plt.subplots(1, 2, figsize=(14, 0.6 * len(choices) + 2.5))
    for ax, parts, key, scale, unit in ((ax_m, MEMORY_PARTS, "memory", 1e9, "GB per rank"),
                                        (ax_t, TIME_PARTS, "time", 1e-3, "ms per step")):
        left = [0.0] * len(choices)
        for part in parts:
            widths = [getattr(ch, key)[part] / scale for ch in choices]
            if not any(widths):
                continue
            ax.barh(labels, widths, left=left, label=part)
            left = [a + b for a, b in zip(left, widths)]
        ax.set_xlabel(unit)
        ax.invert_yaxis()
        # below the axes, in one row: inside them it covers the longest bars
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=len(parts), frameon=False)
    ax_m.axvline(plan.hardware.gpu_memory / 1e9, color="k", linestyle="--", linewidth=1)
    ax_m.set_title("memory per rank (dashed: device)")
    ax_t.set_title("step time")
    ax_t.set_yticklabels([])
    fig.tight_layout()
    plt.close(fig)  # pyplot forgets it; the caller holds it
    return fig
