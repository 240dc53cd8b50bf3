"""Hosts and slots of a Slurm allocation, from its environment. Pure functions.

Inside ``salloc``/``sbatch`` (SLURM_JOB_ID and a node list set, not inside a job step),
``meshspeed run script.py`` runs the script on every node of the allocation with srun:
the hosts come from SLURM_JOB_NODELIST, processes per node from --num_gpus, else
SLURM_NTASKS_PER_NODE, else SLURM_GPUS_ON_NODE, else this node's CUDA device count.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping

NODELIST_VARS = ("SLURM_JOB_NODELIST", "SLURM_NODELIST")


class NodeListError(ValueError):
    """A Slurm node list that does not parse."""


def _split_top(text: str) -> list[str]:
    """Split on commas outside brackets: "a[1-2,4],b" -> ["a[1-2,4]", "b"]."""
    return [part for part in re.split(r",(?![^\[]*\])", text.strip()) if part]


def _expand_range(item: str, nodelist: str) -> list[str]:
    low, dash, high = item.partition("-")
    if not low.isdigit() or (dash and not high.isdigit()):
        raise NodeListError(f"Slurm node list {nodelist!r}: {item!r} is not a number or a range like 003-010")
    if not dash:
        return [low]
    if int(high) < int(low):
        raise NodeListError(f"Slurm node list {nodelist!r}: the range {item!r} runs backwards")
    width = len(low)  # "003-010": zero padding of the first number
    return [str(n).zfill(width) for n in range(int(low), int(high) + 1)]


def expand_nodelist(nodelist: str) -> list[str]:
    """Every host of a compressed Slurm node list, in order:
    "gpu[003-004,010],cpu1" -> ["gpu003", "gpu004", "gpu010", "cpu1"]; several bracket
    groups in one name give every combination, as Slurm does ("r[1-2]n[1-2]")."""
    hosts: list[str] = []
    for name in _split_top(nodelist):
        pieces = re.split(r"(\[[^\]]*\])", name)
        if any("[" in p[1:] or "]" in p[:-1] for p in pieces if p.startswith("[")) or \
                any("[" in p or "]" in p for p in pieces if not p.startswith("[")):
            raise NodeListError(f"Slurm node list {nodelist!r}: unbalanced brackets in {name!r}")
        choices = []
        for piece in pieces:
            if piece.startswith("["):
                choices.append([n for item in piece[1:-1].split(",") for n in _expand_range(item, nodelist)])
            else:
                choices.append([piece])
        hosts += ["".join(combo) for combo in itertools.product(*choices)]
    return list(dict.fromkeys(hosts))


def in_allocation(environ: Mapping[str, str]) -> bool:
    """True inside salloc/sbatch but outside a job step (an srun task runs its share itself)."""
    return ("SLURM_JOB_ID" in environ and any(environ.get(v) for v in NODELIST_VARS)
            and "SLURM_STEP_ID" not in environ and "SLURM_STEPID" not in environ)


def allocation_hosts(environ: Mapping[str, str], num_gpus: int | None, device_count: int) -> dict[str, int]:
    """{host: processes} for every node of the allocation (see the module docstring)."""
    nodelist = next(environ[v] for v in NODELIST_VARS if environ.get(v))
    hosts = expand_nodelist(nodelist)
    slots = num_gpus
    for var in ("SLURM_NTASKS_PER_NODE", "SLURM_GPUS_ON_NODE"):
        if slots is None and environ.get(var, "").isdigit():
            slots = int(environ[var])
    return {h: slots or device_count or 1 for h in hosts}
