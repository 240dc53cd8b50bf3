"""The ZeRO-Infinity buffer settings a user left unset, chosen from the model and the memory.

Note [defaults that fit]
DeepSpeed's defaults size ZeRO-Infinity's buffers for a large GPU server: with
`sub_group_size` 1e9 the optimizer swap pool alone is buffer_count x 4 GB, so the
tutorial's config (stage 3, both offloads on "nvme", a `nvme_path`, nothing else) does not
fit a 24 GiB host for a 2B model (meshspeed/planner/fit.py, Note [the knob that fits]).
When the config is ZeRO-Infinity (stage 3, both offloads on "nvme") `choose` fills in
each of these settings the user did not set; a value the user set is kept as it is.

Buffers buy overlap, not fewer bytes: the bytes a step moves are the same whatever their
size. So each setting starts at the smallest value that still lets the disk work while
the step computes (sizes rounded up to two significant figures unless said):

  offload_optimizer.buffer_count  8: two sub-groups of 4 buffers (master, gradient, two
                                  moments), the next read while the current is updated
  sub_group_size                  the largest parameter slice of a block, rounded up to
                                  1, 2 or 5 x 10^k: a sub-group never splits a parameter,
                                  so below that the pool does not shrink (the embedding's
                                  slice sizes it at dp 1), and above it only the pool grows
  offload_param.buffer_size       one block's shard: a block is read in one request
                                  (the root unit is read in pieces: Note [shards larger
                                  than a staging buffer] in meshspeed/offload/param.py)
  offload_param.buffer_count      5 (DeepSpeed's): the shard in use and reads ahead of it
  stage3_prefetch_bucket_size     one block, so that the next block is gathered while
                                  the current one runs (the Fetcher gathers nothing
                                  ahead when a block is larger than the bucket: the
                                  hand-set 5e7 gathered nothing ahead at 2B, whose
                                  blocks are 5.04e7)
  stage3_max_live_parameters      the root unit and two blocks: the root stays gathered
                                  through forward and backward, plus the running block
                                  and the one gathered ahead

These are the terms of Note [what an everything-on-NVMe rank holds] in
meshspeed/planner/offload.py (`nvme_host_buffers`, the estimate's formula: one formula,
not two). For the 2B GPT of docs/infinity.md they come to 6.5 GiB with the interpreter,
7.4 GiB with the estimate's activations at micro batch 2 x 128 tokens; the hand-set values
of its measured run (sub_group_size 2e7, buffer_count 8, max_live 2e8, buffer_size 1e8)
come to 6.9 and 7.8 GiB, and it peaked at 7.77 GiB.

The peak budget a rank aims at is min(8 GiB, half of MemAvailable / ranks on the host).
When the starting values exceed it, `lower_to_fit` (Note [the knob that fits]) lowers the
unset settings, largest saving first, toward the point where their buffers stop
shrinking; if the budget cannot be met, they are lowered to fit MemAvailable itself; if
even that fails, `choose` says which setting the user set to lower, or that none is left.
Why not use all of MemAvailable: (1) larger buffers than the overlap needs do not make
the step faster; (2) the other half is the room of a partial-residency policy
(`offload_param.max_in_cpu` and its optimizer counterpart keep the first units' state in
RAM, which does cut the bytes a step moves), of the page cache that buffered swap writes
go through, and of what the choice does not count (activations, which initialize does
not know, heap fragmentation, temporaries: the 2B run peaked 0.9 GiB above its buffers
and interpreter, about the activations the estimate gives it); (3) 8 GiB is the figure
the 2B model was shown to train at, and a budget above it buys nothing the overlap needs.
At 0.3B (benchmarks/infinity.py --params 3e8 --tutorial-config) the chosen values peaked
at 2.54-2.61 GiB where the estimate, activations included, says 2.9 GiB, and the hand-set
2B values at 3.02 GiB; the losses were the same bit for bit.

A value that equals DeepSpeed's default is still the user's when it is written: the
dict in DeepSpeed's own ZeRO tutorial writes `sub_group_size` 1e9 and
`stage3_max_live_parameters` 1e9, which are then kept, fitted around, and refused, naming
sub_group_size, only when MemAvailable cannot hold them.
Pure arithmetic, like the estimate: initialize (meshspeed/offload/auto.py) and
`meshspeed estimate` call `choose` with the same sizes and print the same line.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from meshspeed.planner.fit import (
    INTERPRETER,
    KNOBS,
    SETTINGS,
    apply_changes,
    floors_of,
    format_value,
    lower_to_fit,
    round_up,
)
from meshspeed.planner.offload import UnitSizes, host_buffer_bytes, nvme_host_buffers

PEAK_CAP = 8 * 2**30  # bytes a rank aims at, at most (Note [defaults that fit])
SHARE = 0.5  # of MemAvailable per rank, at most
OPTIMIZER_BUFFERS = 8
PARAM_BUFFERS = 5
PREFETCH = "stage3_prefetch_bucket_size"
# the settings `choose` fills in, by config key (zero_optimization's, dotted below it)
KEYS = tuple(k.key for k in KNOBS) + (PREFETCH,)
ARGS = {k.key: k.arg for k in KNOBS} | {PREFETCH: "prefetch_bucket_size"}  # estimate keywords
# DeepSpeed's defaults (and the estimate's when nothing is chosen), by estimate keyword
KNOB_DEFAULTS = SETTINGS


@dataclass
class Choice:
    """The settings for one rank and what they come to."""

    values: dict[str, int]  # every key of KEYS: the user's value or the chosen one
    chosen: tuple[str, ...]  # the keys meshspeed chose (the user left them unset)
    need: int  # bytes per rank with `values`, interpreter included (activations not)
    budget: int  # the peak aimed at
    available: int | None  # MemAvailable per rank (None: unknown)
    num_params: int
    problem: str | None = None  # why nothing fits, naming the setting to lower
    buffers: dict[str, int] = field(default_factory=dict)  # nvme_host_buffers(values)

    @property
    def fits(self) -> bool:
        return self.problem is None


def wanted(sizes: UnitSizes, dp: int) -> dict[str, int]:
    """The starting values of Note [defaults that fit], by config key."""
    block_slice = min(sizes.block_param, -(-sizes.block // dp)) or sizes.largest_slice(dp)
    return {
        "sub_group_size": _one_two_five(max(1, block_slice)),
        "stage3_max_live_parameters": round_up(sizes.root + 2 * sizes.block),
        "offload_param.buffer_size": round_up(max(1, -(-(sizes.block or sizes.root) // dp))),
        "offload_optimizer.buffer_count": OPTIMIZER_BUFFERS,
        "offload_param.buffer_count": PARAM_BUFFERS,
        PREFETCH: round_up(sizes.block),
    }


def _one_two_five(v: int) -> int:
    """The smallest 1, 2 or 5 x 10^k at least `v`: a request size that reads as a setting."""
    e = 10 ** max(0, len(str(v)) - 1)
    return next(m * e for m in (1, 2, 5, 10) if m * e >= v)


def choose(sizes: UnitSizes, dp: int, available: int | None, given: Mapping[str, int], *,
           on_cpu: bool = True, param_bytes: float = 2, comm_bytes: float = 4,
           num_params: int | None = None) -> Choice:
    """Note [defaults that fit]: `given` holds the settings the user set (config key ->
    value); `available` is MemAvailable divided among the host's ranks (None: unknown,
    then only the 8 GiB cap applies); `on_cpu`: the gathered parameters and the gradient
    staging are RAM too."""
    start = wanted(sizes, dp) | {k: int(v) for k, v in given.items() if k in ARGS}
    base = {ARGS[k]: v for k, v in start.items()}

    def need(values: Mapping[str, int]) -> int:
        b = nvme_host_buffers(sizes, dp=dp, param_bytes=param_bytes, comm_bytes=comm_bytes, **values)
        return math.ceil((b["total"] if on_cpu else host_buffer_bytes(b)) + INTERPRETER)

    budget = PEAK_CAP if available is None else int(min(PEAK_CAP, SHARE * available))
    free = [k for k in KNOBS if k.key not in given]
    floors = floors_of(KNOBS, sizes, dp, base)
    values, problem = dict(base), None
    if need(base) > budget:
        for target in [budget] if available is None else [budget, available]:
            changes, fits = lower_to_fit(need, base, floors, target, free)
            values = apply_changes(base, changes)
            if fits:
                break
        else:
            if available is not None:
                problem = _problem(need, values, floors, available, given)
    count = num_params if num_params is not None else sizes.root + sizes.n_blocks * sizes.block
    by_key = {k: values[ARGS[k]] for k in KEYS}
    buffers = nvme_host_buffers(sizes, dp=dp, param_bytes=param_bytes, comm_bytes=comm_bytes, **values)
    return Choice(by_key, tuple(k for k in KEYS if k not in given), need(values), budget,
                  available, count, problem, buffers)


def _problem(need, values, floors, available, given) -> str:
    """Nothing fits MemAvailable with the unset settings at their floors: which of the
    user's settings to lower, or that none is left."""
    mine = [k for k in KNOBS if k.key in given]
    changes, fits = lower_to_fit(need, values, floors, available, mine) if mine else ({}, False)
    head = (f"ZeRO-Infinity's buffers need {need(values) / 2**30:.1f} GiB per rank with every "
            f"unset buffer setting at its smallest, and {available / 2**30:.1f} GiB is available "
            "per rank (MemAvailable over the host's ranks)")
    if fits and changes:
        lower = " and ".join(f"zero_optimization.{k.key} from {format_value(k, given[k.key])} to "
                             f"{format_value(k, changes[k.key])}" for k in KNOBS if k.key in changes)
        return f"{head}; lower {lower} (or leave it unset to let meshspeed choose)"
    return (f"{head}; no buffer setting shrinks it further: use fewer ranks on this host or a "
            "host with more memory")


def format_choice(c: Choice) -> str:
    """The one line initialize logs and `meshspeed estimate` prints."""
    knobs = {k.key: k for k in KNOBS}
    shown = ", ".join(f"{k} {_shown(knobs.get(k), c.values[k])}" for k in c.chosen)
    memory = ("MemAvailable unknown" if c.available is None
              else f"{c.available / 2**30:.1f} GiB available per rank")
    return (f"ZeRO-Infinity: chose {shown} from {c.num_params / 1e9:.2f}B parameters and "
            f"{memory}: about {c.need / 2**30:.1f} GiB per rank of buffers and interpreter, "
            f"aiming at {c.budget / 2**30:.1f} GiB (set them to override)")


def _shown(knob, v: int) -> str:
    return format_value(knob if knob is not None else KNOBS[0], v)  # KNOBS[0]: a size, not a count
