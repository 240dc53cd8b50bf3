"""The FLOPs profiler's text: a summary, the top modules at each depth, a module tree."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from meshspeed.profiling.flops_profiler import FlopsProfiler

_PREFIXES = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K"))


def param_numel(p: torch.Tensor) -> int:
    """A parameter's whole size, also under ZeRO-3, where the tensor between forwards is
    an empty placeholder and `ds_numel` (DeepSpeed's attribute) gives the size. A
    tensor-parallel shard counts as the shard: the figures are this rank's."""
    numel = getattr(p, "ds_numel", None)
    return int(numel) if numel is not None else p.numel()


def human(value: float, unit: str, precision: int = 2) -> str:
    """12_300_000 -> "12.30 MFLOPs" (unit "FLOPs"); plain below 1000."""
    for scale, prefix in _PREFIXES:
        if abs(value) >= scale:
            return f"{value / scale:.{precision}f} {prefix}{unit}".rstrip()
    return f"{value:g} {unit}".rstrip()


def _depth(name: str) -> int:  # "" (the model) is 0, "layers" 1, "layers.0" 2
    return 0 if name == "" else name.count(".") + 1


def _share(part: float, whole: float) -> str:
    return f"{100 * part / whole:.2f}%" if whole else "0%"


def _summary(prof: FlopsProfiler, profile_step: int) -> list[str]:
    fwd_macs, seconds = prof.forward_macs(), prof.get_total_duration()
    other = prof.total_macs - fwd_macs
    lines = [
        f"-------------------------- meshspeed flops profiler (step {profile_step}) --------------------------",
        f"params:                       {human(prof.get_total_params(), '')}",
        f"forward MACs:                 {human(fwd_macs, 'MACs')}",
        f"forward FLOPs:                {human(2 * fwd_macs, 'FLOPs')}",
        f"forward latency:              {seconds * 1e3:.2f} ms",
        f"forward FLOPS:                {human(2 * fwd_macs / seconds, 'FLOPS') if seconds else 'n/a'}",
    ]
    if other:  # a backward (or anything else) ran inside the region
        lines.append(f"FLOPs outside module forwards: {human(2 * other, 'FLOPs')} (backward, recompute, ...)")
    lines.append(f"total FLOPs:                  {human(prof.get_total_flops(), 'FLOPs')}")
    lines.append("FLOPs count matrix products only (mm, bmm, convolution, attention); 1 MAC = 2 FLOPs")
    return lines


def _top(prof: FlopsProfiler, module_depth: int, top_modules: int) -> list[str]:
    stats = prof.module_stats()
    deepest = max(_depth(n) for n in stats)
    last = deepest if module_depth < 0 else min(module_depth, deepest)
    lines = [f"top {top_modules} modules by MACs and by latency at each depth:"]
    for depth in range(last + 1):
        at = [(n or "(model)", s) for n, s in stats.items() if _depth(n) == depth]
        by_macs = sorted(at, key=lambda x: -x[1].macs)[:top_modules]
        by_time = sorted(at, key=lambda x: -x[1].latency)[:top_modules]
        lines.append(f"  depth {depth}: MACs " + ", ".join(f"{n} {human(s.macs, 'MACs')}" for n, s in by_macs)
                     + " | latency " + ", ".join(f"{n} {s.latency * 1e3:.2f} ms" for n, s in by_time))
    return lines


def _tree(prof: FlopsProfiler, module_depth: int) -> list[str]:
    total_macs = prof.forward_macs()
    total_time = prof.get_total_duration()
    lines = ["module tree (params, share of params, MACs, share of forward MACs, latency, share):"]
    for name, module in prof.model.named_modules():
        depth = _depth(name)
        if module_depth >= 0 and depth > module_depth:
            continue
        s = prof._stats_of(module)
        params = sum(param_numel(p) for p in module.parameters())
        macs, latency = s.macs, s.latency
        label = (name.rsplit(".", 1)[-1] if name else "(model)") + f" ({type(module).__name__})"
        lines.append(f"{'  ' * depth}{label}: {human(params, '')} params, "
                     f"{_share(params, prof.get_total_params())}, {human(macs, 'MACs')}, "
                     f"{_share(macs, total_macs)}, {latency * 1e3:.3f} ms, {_share(latency, total_time)}")
    return lines


def format_profile(prof: FlopsProfiler, profile_step: int = 1, module_depth: int = -1, top_modules: int = 1,
                   detailed: bool = True) -> str:
    """The profile as text: summary, top modules per depth and, when `detailed`, the tree
    down to `module_depth` (-1: every depth)."""
    lines = _summary(prof, profile_step) + _top(prof, module_depth, top_modules)
    if detailed:
        lines += _tree(prof, module_depth)
    return "\n".join(lines)
