"""The machine the planner prices: link speeds, latencies, peak FLOP/s, memory; and the
alpha-beta time of each collective (Hockney's model: alpha per message step, bytes over
bandwidth). Pure arithmetic.

Note [collective times]
A ring over n ranks moves (n-1)/n of the buffer per rank for a reduce-scatter, an
all-gather or an all-to-all, and twice that for an all-reduce (reduce-scatter then
all-gather). Latency: a ring pays alpha n-1 times (2(n-1) for an all-reduce), a tree or
recursive doubling ceil(log2 n) times; libraries such as NCCL pick the tree when messages
are small, so the model charges the smaller count with the ring's bandwidth term (the
best of both: optimistic by at most that choice). A group
that spans nodes runs at the inter-node link's speed: a ring is as slow as its slowest
hop (hierarchical algorithms do better; this is the conservative figure).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

_UNITS = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "KI": 2**10, "MI": 2**20,
          "GI": 2**30, "TI": 2**40}


def parse_bytes(value: float | str, what: str = "size") -> float:
    """80GB, 80GiB, 900GB/s, 1.5e9 or a plain number -> bytes (or bytes per second)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value <= 0:
            raise ValueError(f"{what} must be positive, got {value}")
        return float(value)
    m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([KMGT]i?)?B?(/s)?\s*", str(value), re.IGNORECASE)
    if m is None:
        raise ValueError(f"{what}: cannot read {value!r}; write it as e.g. 80GB, 80GiB or 900GB/s")
    number = float(m.group(1))
    if number <= 0:
        raise ValueError(f"{what} must be positive, got {value!r}")
    return number * _UNITS[(m.group(2) or "").upper()]


@dataclass(frozen=True)
class Link:
    """One kind of link: bandwidth in bytes/s per rank, latency alpha in seconds per step."""

    bandwidth: float
    alpha: float

    def ring(self, n: int, nbytes: float, factor: float = 1.0) -> float:
        """`factor` rings of (n-1)/n of nbytes (1: reduce-scatter/all-gather/all-to-all,
        2: all-reduce). Note [collective times]."""
        if n <= 1 or nbytes <= 0:
            return 0.0
        steps = min(n - 1, math.ceil(math.log2(n)))
        return factor * (steps * self.alpha + (n - 1) / n * nbytes / self.bandwidth)

    def p2p(self, nbytes: float) -> float:
        return 0.0 if nbytes <= 0 else self.alpha + nbytes / self.bandwidth


@dataclass(frozen=True)
class Hardware:
    """What the planner needs to know of the cluster."""

    gpus: int
    gpu_memory: float  # bytes per device
    gpus_per_node: int = 8
    peak_flops: float = 400e12  # dense bf16 FLOP/s per device (H100 SXM: ~990e12 spec, ~400-600 reached)
    mfu: float = 0.5  # fraction of peak a well-sized GEMM reaches (stated, not measured)
    intra: Link = Link(900e9, 5e-6)  # NVLink-class
    inter: Link = Link(50e9, 20e-6)  # one 400 Gb/s NIC per GPU
    pcie: float = 25e9  # host <-> device bytes/s, for offload
    cpu_adam: float = 1e9  # parameters per second a host Adam step reaches per rank
    layer_overhead: float = 0.0  # seconds per layer per micro-batch (launches, Python)
    overlap: float = 0.8  # fraction of data-parallel traffic that can hide under compute

    def __post_init__(self):
        if self.gpus < 1 or self.gpus_per_node < 1:
            raise ValueError(f"gpus ({self.gpus}) and gpus_per_node ({self.gpus_per_node}) must be >= 1")
        if not 0 < self.mfu <= 1 or not 0 <= self.overlap <= 1:
            raise ValueError(f"mfu must be in (0, 1] and overlap in [0, 1], got {self.mfu}, {self.overlap}")

    @property
    def flops(self) -> float:
        """FLOP/s one device sustains."""
        return self.peak_flops * self.mfu

    def link(self, stride: int, size: int) -> Link:
        """The link a group of `size` ranks `stride` apart (ranks numbered node by node)
        runs at: intra-node when the whole group fits in one node."""
        return self.intra if stride * size <= self.gpus_per_node else self.inter

    def crosses_nodes(self, stride: int, size: int) -> bool:
        return size > 1 and stride * size > self.gpus_per_node


def available_memory() -> int | None:
    """MemAvailable from /proc/meminfo, in bytes; None where it cannot be read. (The same
    reader as process.accelerator.meminfo_bytes, which this layer's contract keeps out of
    reach: planner and process are independent siblings in .importlinter.)"""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def parse_links(spec: str | dict | None) -> dict[str, float]:
    """"intra=900GB/s,inter=50GB/s" or {"intra": "900GB/s", ...} -> bytes/s per name."""
    if spec is None:
        return {}
    if isinstance(spec, str):
        items = {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            name, sep, value = part.partition("=")
            if not sep:
                raise ValueError(f"link {part!r}: write NAME=SPEED, e.g. intra=900GB/s,inter=50GB/s")
            items[name.strip()] = value.strip()
        spec = items
    unknown = set(spec) - {"intra", "inter", "pcie"}
    if unknown:
        raise ValueError(f"unknown link {', '.join(sorted(unknown))}; the links are intra, inter, pcie")
    return {k: parse_bytes(v, f"link {k}") for k, v in spec.items()}
