"""Which rank runs on which host, and which ranks see the same checkpoint directory.

Note [checkpoints on node-local disks]
With `checkpoint.use_node_local_storage`, `<save_dir>` is the same path on every host but
each host's own disk. A save then runs as many publications as there are disks: the
ranks are grouped by what they see (every host's first rank, by hostname, creates the
temporary directory and leaves a probe file in it; a rank that sees a probe shares a disk
with the rank that left it), the lowest rank of each group does on its disk what rank 0 does alone on shared
storage (Note [publishing a checkpoint] in writer.py), and every disk gets the same
meta.json, which also records each rank's hostname. Where the directory is shared after
all (one host, or a shared file system), there is one group and the save is the usual one.
Loading reads what is on this host's disk; a file that a rank needs and its host lacks is
sent by a rank whose host holds it (fetch.py), so the same layout and any other layout load
alike. Files on no host of the job (a host that is gone) need the checkpoint gathered first
(`meshspeed gather-checkpoint`, gather.py).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from meshspeed import comm

PROBE = ".host-rank-"  # a probe file in a temporary directory: `.host-rank-00002`


@dataclass(frozen=True)
class Placement:
    """The hostname of every rank of the job, as the ranks themselves report it."""

    hostnames: tuple[str, ...]

    @property
    def hosts(self) -> list[str]:
        """Distinct hostnames, in order of their first rank."""
        return list(dict.fromkeys(self.hostnames))

    def ranks_on(self, host: str) -> list[int]:
        return [r for r, h in enumerate(self.hostnames) if h == host]

    def leader(self, rank: int) -> int:
        """The first rank on `rank`'s host: it does that host's share of rank 0's work."""
        return self.hostnames.index(self.hostnames[rank])

    def describe(self, ranks: list[int]) -> str:
        """'ranks 2, 3 (on node1)' for messages."""
        hosts = ", ".join(dict.fromkeys(self.hostnames[r] for r in ranks))
        word = "rank" if len(ranks) == 1 else "ranks"
        return f"{word} {', '.join(map(str, ranks))} (on {hosts})"


def gather_placement() -> Placement:
    """Collective: every rank's hostname (one small all-gather)."""
    return Placement(tuple(comm.all_gather_object(socket.gethostname())))


def probe_name(rank: int) -> str:
    return f"{PROBE}{rank:05d}"


def leave_probe(tmp: str, rank: int) -> None:
    with open(os.path.join(tmp, probe_name(rank)), "w", encoding="utf-8"):
        pass


def remove_probes(tmp: str) -> None:
    for name in os.listdir(tmp):
        if name.startswith(PROBE):
            os.remove(os.path.join(tmp, name))


def probes_seen(tmp: str) -> tuple[int, ...]:
    """The ranks whose probe files this rank sees in `tmp` (empty when it sees no `tmp`)."""
    try:
        names = os.listdir(tmp)
    except OSError:
        return ()
    return tuple(sorted(int(n[len(PROBE):]) for n in names if n.startswith(PROBE)))


def storage_groups(seen: list[tuple[int, ...]]) -> list[list[int]]:
    """Ranks on one disk: a rank that sees a probe shares the disk of the rank that left it,
    so the groups are the connected parts of "sees" (a network file system that shows one
    rank a probe late still puts every rank on it in one group). Each group sorted, groups
    by lowest rank; a pure function of what every rank saw, so every rank computes the same."""
    parent = list(range(len(seen)))

    def root(r: int) -> int:
        while parent[r] != r:
            parent[r] = parent[parent[r]]
            r = parent[r]
        return r

    for rank, probes in enumerate(seen):
        for other in probes:
            parent[root(rank)] = root(other)
    groups: dict[int, list[int]] = {}
    for rank in range(len(seen)):
        groups.setdefault(root(rank), []).append(rank)
    return sorted(groups.values())


def gather_hint(path: str, meta: dict | None, on: str | None = None) -> str:
    """How to gather checkpoint `path`: into a DIR to load from, or (`on`: hosts lacking it)
    into the same path on those hosts."""
    parent, tag = os.path.split(os.path.normpath(path))
    command = f"meshspeed gather-checkpoint --hostfile HOSTFILE --tag {tag} {parent}"
    if on is not None:
        return f"run `{command}` on {on} (it copies every host's files there over ssh)"
    saved_on = f"; it was saved on {', '.join(dict.fromkeys(meta['storage']['hosts']))}" if meta else ""
    return (f"gather it first with `{command} --to DIR` (it copies every host's files into DIR "
            f"over ssh{saved_on}) and load from DIR")
