"""Does a ZeRO-Infinity rank fit the host's memory, and if not, which setting makes it fit.

Note [the knob that fits]
With everything on NVMe (meshspeed/planner/offload.py, Note [what an everything-on-NVMe
rank holds]) memory holds buffers whose sizes are settings, not the model. With the
defaults (DeepSpeed's) they are large: `sub_group_size` 1e9 makes the optimizer swap pool
buffer_count x 4 GB. When the buffers, plus the activations when the devices are CPUs,
plus about 0.25 GiB of interpreter and torch, times the ranks on the host, exceed what the
host has, `fit` names the settings to lower and the largest round value (1, 2 or 5 x 10^k)
of each that fits, trying one setting alone first (the one whose buffer shrinks most),
then more together. A setting is never lowered below the point where its buffer stops
shrinking (the largest parameter slice for `sub_group_size`, one block for
`stage3_max_live_parameters`, one block's shard for `offload_param.buffer_size`) or where
the engine refuses it (4 optimizer buffers: masters, gradients and two moments of one
sub-group; 2 parameter buffers to overlap reads). Pure arithmetic, like the estimate.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from meshspeed.planner.activations import ModelShape, block_param_count
from meshspeed.planner.offload import host_buffer_bytes, nvme_host_buffers, root_param_count

INTERPRETER = 0.25 * 2**30  # Python and torch themselves, per process (offload.py's Note)


@dataclass(frozen=True)
class Knob:
    """One buffer setting: its config key, the estimate's flag, nvme_host_buffers' keyword."""

    key: str
    flag: str
    arg: str
    buffer: str  # the nvme_host_buffers item it sizes
    default: int  # DeepSpeed's (and meshspeed's) default
    floor: Callable[[ModelShape, int, Mapping[str, int]], int]  # (shape, dp, settings)
    count: bool = False  # a number of buffers (steps of 1), not a size in elements


def _largest_slice(s: ModelShape, dp: int, _: Mapping[str, int]) -> int:
    root, block = root_param_count(s), block_param_count(s)
    return max(min(s.vocab_size * s.d_model, -(-root // dp)), min(s.ffn * s.d_model, -(-block // dp)))


def _one_block(s: ModelShape, _: int, settings: Mapping[str, int]) -> int:
    return max(0, block_param_count(s) - settings["prefetch_bucket_size"])


def _block_shard(s: ModelShape, dp: int, _: Mapping[str, int]) -> int:
    return -(-block_param_count(s) // dp)


KNOBS = (
    Knob("sub_group_size", "--sub-group-size", "sub_group_size", "optimizer_swap_buffers",
         1_000_000_000, _largest_slice),
    Knob("stage3_max_live_parameters", "--max-live-parameters", "max_live_parameters",
         "gathered_params", 1_000_000_000, _one_block),
    Knob("offload_param.buffer_size", "--param-buffer-size", "param_buffer_size",
         "param_swap_buffers", 100_000_000, _block_shard),
    Knob("offload_optimizer.buffer_count", "--optimizer-buffer-count", "optimizer_buffer_count",
         "optimizer_swap_buffers", 4, lambda *_: 4, count=True),
    Knob("offload_param.buffer_count", "--param-buffer-count", "param_buffer_count",
         "param_swap_buffers", 5, lambda *_: 2, count=True),
)
SETTINGS = {k.arg: k.default for k in KNOBS} | {"prefetch_bucket_size": 50_000_000}


@dataclass
class Fit:
    """The verdict: bytes needed and available, and the settings that make it fit."""

    need: int  # with the given settings, all ranks on the host, interpreter included
    available: int
    on_cpu: bool
    ranks: int
    settings: dict[str, int]  # nvme_host_buffers' keywords as given (defaults filled in)
    buffers: dict[str, int]  # nvme_host_buffers with those settings
    changes: dict[str, int] = field(default_factory=dict)  # knob key -> the value that fits
    need_after: int | None = None  # with `changes`, or with every knob at its floor
    fits_after: bool = False

    @property
    def fits(self) -> bool:
        return self.need <= self.available


def fit(shape: Any, available: float, *, dp: int = 1, param_bytes: float = 2,
        comm_bytes: float = 4, activations: int = 0, on_cpu: bool = True, ranks: int = 1,
        **settings: int) -> Fit:
    """Note [the knob that fits]: `settings` are nvme_host_buffers' keywords (SETTINGS are
    the defaults); `activations` are one rank's bytes, counted when `on_cpu`."""
    s = ModelShape.from_any(shape)
    unknown = set(settings) - set(SETTINGS)
    if unknown:
        raise ValueError(f"unknown buffer setting {', '.join(sorted(unknown))}; "
                         f"the settings are {', '.join(SETTINGS)}")
    base = SETTINGS | settings

    def buffers(values: Mapping[str, int]) -> dict[str, int]:
        return nvme_host_buffers(s, dp=dp, param_bytes=param_bytes, comm_bytes=comm_bytes, **values)

    def need(values: Mapping[str, int]) -> int:
        b = buffers(values)
        held = b["total"] + activations if on_cpu else host_buffer_bytes(b)
        return math.ceil(ranks * (held + INTERPRETER))

    out = Fit(need(base), int(available), on_cpu, ranks, dict(base), buffers(base))
    if out.fits:
        return out
    floors = {k.key: min(base[k.arg], _round_up(k.floor(s, dp, base))) for k in KNOBS}
    by_saving = sorted(
        (k for k in KNOBS if need(base | {k.arg: floors[k.key]}) < out.need),
        key=lambda k: need(base | {k.arg: floors[k.key]}))
    chosen: dict[str, int] = {}
    for knob in by_saving:  # one alone if one suffices, else the biggest savers together
        alone = base | {knob.arg: floors[knob.key]}
        if need(alone) <= available:
            chosen = {knob.key: floors[knob.key]}
            break
    else:
        for knob in by_saving:
            chosen[knob.key] = floors[knob.key]
            if need(_apply(base, chosen)) <= available:
                break
    fits_now = need(_apply(base, chosen)) <= available
    if fits_now:  # raise each chosen knob back to the largest round value that still fits
        for knob in [k for k in KNOBS if k.key in chosen][::-1]:
            for value in _candidates(knob, floors[knob.key], base[knob.arg]):
                if need(_apply(base, chosen | {knob.key: value})) <= available:
                    chosen[knob.key] = value
                    break
    out.changes = chosen
    out.need_after = need(_apply(base, chosen))
    out.fits_after = fits_now
    return out


def _apply(base: Mapping[str, int], chosen: Mapping[str, int]) -> dict[str, int]:
    by_key = {k.key: k.arg for k in KNOBS}
    return dict(base) | {by_key[key]: value for key, value in chosen.items()}


def _candidates(knob: Knob, floor: int, current: int) -> list[int]:
    """Values between floor and current, largest first: every count, or 1-2-5 sizes."""
    if knob.count:
        return list(range(current - 1, floor, -1))
    values = {m * 10**e for e in range(13) for m in (1, 2, 5)}
    return sorted((v for v in values if floor < v < current), reverse=True)


def format_fit(f: Fit, source: str) -> str:
    """One sentence: fits, or what to lower to what (Note [the knob that fits])."""
    where = "device + host buffers and activations, all RAM on a CPU" if f.on_cpu else \
        "the host buffers"
    per = f" for {f.ranks} ranks" if f.ranks > 1 else ""
    if f.fits:
        return (f"host memory: fits, {_gb(f.need)} GB{per} ({where}, plus 0.25 GiB for Python "
                f"and torch) of the {_gb(f.available)} GB available ({source}).")
    head = (f"host memory: does not fit, {_gb(f.need)} GB{per} ({where}, plus 0.25 GiB for "
            f"Python and torch) against {_gb(f.available)} GB available ({source})")
    knobs = [k for k in KNOBS if k.key in f.changes]
    if not knobs:
        return head + "; no buffer setting shrinks it: use a machine with more memory."
    first = knobs[0]
    current = f.buffers[first.buffer]
    now = _value(first, f.settings[first.arg])
    why = (f"with {first.key} {now}{' (the default)' if f.settings[first.arg] == first.default else ''} "
           f"the {first.buffer.replace('_', ' ')} need {_gb(current)} GB")
    if not f.fits_after:
        lowest = " and ".join(f"{k.key} {_value(k, f.changes[k.key])}" for k in knobs)
        acts = ", fewer activations (a smaller micro batch, activation checkpointing)" \
            if f.on_cpu else ""
        return (f"{head}; {why}, and even {lowest} (where the buffers stop shrinking) leave "
                f"{_gb(f.need_after)} GB: use fewer ranks on this host{acts} or more memory.")
    new = " and ".join(f"{k.key} {_value(k, f.changes[k.key])}" for k in knobs)
    flags = " ".join(f"{k.flag} {_value(k, f.changes[k.key])}" for k in knobs)
    return f"{head}; {why}: {new} fit{'s' if len(knobs) == 1 else ''} in {_gb(f.need_after)} GB ({flags})."


def _round_up(v: int) -> int:
    """Up to two significant figures (67108864 -> 68000000), so a floor reads as a setting."""
    if v < 100:
        return v
    step = 10 ** (len(str(v)) - 2)
    return -(-v // step) * step


def _value(knob: Knob, v: int) -> str:
    if knob.count or v < 10_000:
        return str(int(v))
    mantissa, exponent = f"{v:.2g}".split("e")
    return f"{mantissa}e{int(exponent)}"


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.3g}"
