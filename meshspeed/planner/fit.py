"""Does an offloading rank fit the host's memory, and if not, which setting makes it fit.

Note [the knob that fits]
With the optimizer on NVMe, and most of all with everything there (meshspeed/planner/
offload.py, Note [what an everything-on-NVMe rank holds]), memory holds buffers whose
sizes are settings, not the model. With the defaults (DeepSpeed's) they are large:
`sub_group_size` 1e9 makes the optimizer swap pool buffer_count x 4 GB. What a rank holds
in RAM is the estimate's host tier, and its device tier too when the devices are CPUs;
with about 0.25 GiB of interpreter and torch, times the ranks on the host, it is compared
with what the host has. When it does not fit, `fit` names the settings to lower and the
largest round value (1, 2 or 5 x 10^k) of each that fits, trying one setting alone first
(the one that saves most), then more together, re-estimating each time. A setting is never lowered below the point where its buffer stops
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

from meshspeed.planner.estimate import estimate_memory
from meshspeed.planner.offload import UnitSizes, assumed_shape

INTERPRETER = 0.25 * 2**30  # Python and torch themselves, per process (offload.py's Note)


@dataclass(frozen=True)
class Knob:
    """One buffer setting: its config key, the estimate's flag, nvme_host_buffers' keyword."""

    key: str
    flag: str
    arg: str
    buffer: str  # the nvme_host_buffers item it sizes
    default: int  # DeepSpeed's (and meshspeed's) default
    floor: Callable[[UnitSizes, int, Mapping[str, int]], int]  # (sizes, dp, settings)
    count: bool = False  # a number of buffers (steps of 1), not a size in elements


def _largest_slice(u: UnitSizes, dp: int, _: Mapping[str, int]) -> int:
    return u.largest_slice(dp)


def _one_block(u: UnitSizes, _: int, settings: Mapping[str, int]) -> int:
    return max(0, u.block - settings["prefetch_bucket_size"])


def _block_shard(u: UnitSizes, dp: int, _: Mapping[str, int]) -> int:
    return -(-u.block // dp)


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
    settings: dict[str, int]  # the knobs' values as given (defaults filled in)
    buffers: dict[str, int]  # the estimate's itemised buffers (offload and comm)
    changes: dict[str, int] = field(default_factory=dict)  # knob key -> the value that fits
    need_after: int | None = None  # with `changes`, or with every knob at its floor
    fits_after: bool = False
    nvme: Fit | None = None  # a host-offloaded optimizer that does not fit: the same on NVMe
    nvme_keys: tuple[str, ...] = ()  # (in `nvme`) the offload settings moved to "nvme"

    @property
    def fits(self) -> bool:
        return self.need <= self.available


def in_memory(estimate: Mapping[str, Any], on_cpu: bool) -> int:
    """Bytes of one rank in RAM: the host tier, and the device tier too when the devices
    are CPUs."""
    tiers = estimate["tiers"]
    return tiers["host"] + (tiers["device"] if on_cpu else 0)


def fit(num_params: float, dp: int, stage: int, available: float, *, on_cpu: bool = True,
        ranks: int = 1, **kwargs: Any) -> Fit:
    """Note [the knob that fits] for estimate_memory(num_params, dp, stage, **kwargs):
    the knobs are its keywords of the same names (KNOBS; absent ones take their defaults)."""
    base = SETTINGS | {k: v for k, v in kwargs.items() if k in SETTINGS}
    rest = {k: v for k, v in kwargs.items() if k not in SETTINGS}

    def need(values: Mapping[str, int]) -> int:
        est = estimate_memory(num_params, dp, stage, **rest, **values)
        return math.ceil(ranks * (in_memory(est, on_cpu) + INTERPRETER))

    first = estimate_memory(num_params, dp, stage, **rest, **base)
    buffers = first["detail"]["comm_buffers"] | first["detail"].get("offload_buffers", {})
    out = Fit(need(base), int(available), on_cpu, ranks, dict(base), dict(buffers))
    if out.fits:
        return out
    sizes = UnitSizes.of(rest.get("model_shape") or first.get("assumed_shape")
                         or assumed_shape(num_params))
    floors = floors_of(KNOBS, sizes, dp, base)
    chosen, fits_now = lower_to_fit(need, base, floors, available, KNOBS)
    out.changes = chosen
    out.need_after = need(apply_changes(base, chosen))
    out.fits_after = fits_now and bool(chosen)
    if not out.fits_after and rest.get("offload_optimizer") == "cpu":
        to_nvme = {"offload_optimizer": "nvme"} | (
            {"offload_param": "nvme"} if rest.get("offload_param") else {})
        out.nvme = fit(num_params, dp, stage, available, on_cpu=on_cpu, ranks=ranks,
                       **(rest | to_nvme), **base)
        out.nvme.nvme_keys = tuple(to_nvme)
    return out


def floors_of(knobs, sizes: UnitSizes, dp: int, base: Mapping[str, int]) -> dict[str, int]:
    """Each knob's floor (Note [the knob that fits]), rounded up to read as a setting, and
    never above its value in `base`."""
    return {k.key: min(base[k.arg], round_up(k.floor(sizes, dp, base))) for k in knobs}


def lower_to_fit(need: Callable[[Mapping[str, int]], int], base: Mapping[str, int],
                 floors: Mapping[str, int], available: float,
                 knobs=KNOBS) -> tuple[dict[str, int], bool]:
    """The search of Note [the knob that fits] over `knobs` only (the others stay as in
    `base`): the knob key -> value changes, and whether `need` then fits `available`."""
    saving = {k.key: need(apply_changes(base, {k.key: floors[k.key]})) for k in knobs}
    current = need(base)
    by_saving = sorted((k for k in knobs if saving[k.key] < current), key=lambda k: saving[k.key])
    chosen: dict[str, int] = {}
    for knob in by_saving:  # one alone if one suffices, else the biggest savers together
        if saving[knob.key] <= available:
            chosen = {knob.key: floors[knob.key]}
            break
    else:
        for knob in by_saving:
            chosen[knob.key] = floors[knob.key]
            if need(apply_changes(base, chosen)) <= available:
                break
    fits_now = need(apply_changes(base, chosen)) <= available
    if fits_now:  # raise each chosen knob back to the largest round value that still fits
        for knob in [k for k in knobs if k.key in chosen][::-1]:
            for value in _candidates(knob, floors[knob.key], base[knob.arg]):
                if need(apply_changes(base, chosen | {knob.key: value})) <= available:
                    chosen[knob.key] = value
                    break
    return chosen, fits_now


def apply_changes(base: Mapping[str, int], chosen: Mapping[str, int]) -> dict[str, int]:
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
    where = "on device + on host, both RAM on a CPU" if f.on_cpu else "on host"
    per = f" for {f.ranks} ranks" if f.ranks > 1 else ""
    if f.fits:
        return (f"host memory: fits, {_gb(f.need)} GB{per} ({where}, plus 0.25 GiB for Python "
                f"and torch) of the {_gb(f.available)} GB available ({source}).")
    head = (f"host memory: does not fit, {_gb(f.need)} GB{per} ({where}, plus 0.25 GiB for "
            f"Python and torch) against {_gb(f.available)} GB available ({source})")
    if f.fits_after:
        return f"{head}; {_why(f)}: {_settings(f)} fit{_s(f)} in {_gb(f.need_after)} GB ({_flags(f)})."
    if f.nvme is not None and (f.nvme.fits or f.nvme.fits_after):
        n = f.nvme
        devices = " and ".join(f"{k}.device" for k in n.nvme_keys)
        flags = " ".join(f"--{k.replace('_', '-')} nvme" for k in n.nvme_keys)
        tail = (f" with {_settings(n)} fit{_s(n)} in {_gb(n.need_after)} GB ({flags} {_flags(n)})"
                if n.changes else f" fits in {_gb(n.need)} GB ({flags})")
        return f"{head}, and no buffer setting makes it fit; {devices} \"nvme\"{tail}."
    if not f.changes:
        return f"{head}; no buffer setting shrinks it: use more memory or more ranks over more hosts."
    acts = ", fewer activations (a smaller micro batch, activation checkpointing)" if f.on_cpu else ""
    return (f"{head}; {_why(f)}, and even {_settings(f)} (where the buffers stop shrinking) "
            f"leave {_gb(f.need_after)} GB: use fewer ranks on this host{acts} or more memory.")


def _why(f: Fit) -> str:
    first = next(k for k in KNOBS if k.key in f.changes)
    default = " (the default)" if f.settings[first.arg] == first.default else ""
    return (f"with {first.key} {format_value(first, f.settings[first.arg])}{default} the "
            f"{first.buffer.replace('_', ' ')} need {_gb(f.buffers[first.buffer])} GB")


def _settings(f: Fit) -> str:
    return " and ".join(f"{k.key} {format_value(k, f.changes[k.key])}" for k in KNOBS if k.key in f.changes)


def _flags(f: Fit) -> str:
    return " ".join(f"{k.flag} {format_value(k, f.changes[k.key])}" for k in KNOBS if k.key in f.changes)


def _s(f: Fit) -> str:
    return "s" if len(f.changes) == 1 else ""


def round_up(v: int) -> int:
    """Up to two significant figures (67108864 -> 68000000), so a floor reads as a setting."""
    if v < 100:
        return v
    step = 10 ** (len(str(v)) - 2)
    return -(-v // step) * step


def format_value(knob: Knob, v: int) -> str:
    if knob.count or v < 10_000:
        return str(int(v))
    mantissa, exponent = f"{v:.2g}".split("e")
    return f"{mantissa}e{int(exponent)}"


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.3g}"
