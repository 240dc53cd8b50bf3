"""Loading a checkpoint saved on node-local disks: each host reads its own disk, and the
files a rank needs that its host lacks are sent over the network by a rank whose host holds
them (Note [checkpoints on node-local disks] in hosts.py).

Note [fetching a node-local checkpoint's files]
Every rank knows which files it will read (its read plans, the buffers' and client
state's files, its own file for its RNG state) and which files its host's disk holds; one
all-gather of those lists gives every rank the same transfer list: per file and per host
that needs it and lacks it, one sending rank (holders taken in turn) and one receiving rank
(the first rank of that host that needs it). Transfers are whole files, in chunks of
CHUNK_BYTES over point-to-point sends, in one order on every rank (so every send meets its
receive), and the receiver writes the file into the checkpoint directory on its disk only
once its SHA-256 matches meta.json: the host's copy becomes more complete and a later load
there sends nothing. At the saving layout under ZeRO each rank reads only its own file, so
nothing moves except rank 0's file (persistent buffers) to the other hosts; at another
layout each host receives what its ranks' new ranges need. A file on no host of this job
(its host is gone) cannot be sent: the load fails in one sentence naming the gather command.
"""

from __future__ import annotations

import hashlib
import os
import socket

import torch

from meshspeed import comm
from meshspeed.checkpoint.agree import agree
from meshspeed.checkpoint.atomic import temp_name
from meshspeed.checkpoint.errors import CheckpointError
from meshspeed.checkpoint.hosts import Placement, gather_hint
from meshspeed.checkpoint.paths import CLIENT_TENSORS
from meshspeed.checkpoint.reshard import verify_file

CHUNK_BYTES = 16 << 20


def is_node_local(meta: dict) -> bool:
    return bool((meta.get("storage") or {}).get("node_local"))


def verify_local(path: str, meta: dict, placement: Placement, rank: int) -> None:
    """The node-local form of reshard.verify_files: the files on this host's disk, shared
    out among this host's ranks; files the host lacks are checked when they arrive."""
    host = placement.ranks_on(placement.hostnames[rank])
    present = [n for n in sorted(meta["files"]) if os.path.isfile(os.path.join(path, n))]
    for i, name in enumerate(present):
        if host[i % len(host)] == rank:
            verify_file(os.path.join(path, name), meta["files"][name])


def files_needed(meta: dict, plans: dict, rank: int) -> set[str]:
    """The files this rank reads in load_checkpoint (a superset is fine)."""
    needed = {r["file"] for plan in plans.values() for r in plan.ranges}
    rank0_file = next(r["file"] for r in meta["ranks"] if r["rank"] == 0)
    needed |= {info.get("file", rank0_file) for info in meta["buffers"].values()}
    needed |= {r["file"] for r in meta["ranks"] if r["rank"] == rank}
    if meta.get("client_tensors"):
        needed.add(CLIENT_TENSORS)
    return needed


def plan_transfers(meta: dict, placement: Placement, have: list[list[str]],
                   lack: list[list[str]]) -> tuple[list[tuple[str, int, int]], dict[str, list[str]]]:
    """Pure: ([(file, sending rank, receiving rank)], {file nobody holds: hosts needing it})."""
    transfers, unheld = [], {}
    for name in sorted(meta["files"]):
        holders = [r for r, files in enumerate(have) if name in files]
        for host in placement.hosts:
            needers = [r for r in placement.ranks_on(host) if name in lack[r]]
            if not needers:
                continue
            if not holders:
                unheld.setdefault(name, []).append(host)
                continue
            transfers.append((name, holders[len(transfers) % len(holders)], needers[0]))
    return transfers, unheld


def open_on_every_host(open_fn, load_dir, tag) -> tuple[str, dict]:
    """Collective `open_fn(load_dir, tag) -> (path, meta)` on every rank, raising on every
    rank if it failed anywhere; where it failed only on ranks whose disks lack a node-local
    checkpoint that other hosts hold (a new or replaced host), in one sentence naming them and
    the gather command instead of a missing path."""
    try:
        result, error = open_fn(load_dir, tag), None
    except Exception as err:  # noqa: BLE001 - any failure must reach the other ranks
        result, error = None, err
    views = comm.all_gather_object((None if error else result[0],
                                    error is None and is_node_local(result[1]), socket.gethostname()))
    failed = [r for r, v in enumerate(views) if v[0] is None]
    if failed and len(failed) < len(views) and all(v[1] for v in views if v[0] is not None):
        path = next(v[0] for v in views if v[0] is not None)
        where = Placement(tuple(v[2] for v in views))
        holders = list(dict.fromkeys(where.hostnames[r] for r in range(len(views)) if r not in failed))
        raise CheckpointError(
            f"{where.describe(failed)} {'lacks' if len(failed) == 1 else 'lack'} checkpoint {path}, saved on node-local disks and held "
            f"by {', '.join(holders)}: "
            f"{gather_hint(path, None, ', '.join(dict.fromkeys(where.hostnames[r] for r in failed)))}"
            ) from error
    agree(error)
    return result


def fetch_missing(path: str, meta: dict, needed: set[str], placement: Placement) -> int:
    """Collective: bring the files this rank needs onto its host's disk (Note [fetching a
    node-local checkpoint's files]); returns the bytes this rank received."""
    have = sorted(n for n in meta["files"] if os.path.isfile(os.path.join(path, n)))
    lack = sorted(needed - set(have))
    info = comm.all_gather_object((have, lack))
    transfers, unheld = plan_transfers(meta, placement, [h for h, _ in info], [lk for _, lk in info])
    if unheld:
        name, hosts = next(iter(unheld.items()))
        more = f" (and {len(unheld) - 1} more file{'s' if len(unheld) > 2 else ''})" if len(unheld) > 1 else ""
        raise CheckpointError(
            f"checkpoint {path} was saved on node-local disks, and {name}{more}, needed on "
            f"{', '.join(hosts)}, is on no host of this job: {gather_hint(path, meta)}")
    rank, error, received = comm.get_rank(), None, 0
    for name, src, dst in transfers:
        size = int(meta["files"][name]["bytes"])
        if rank == src:
            error = _send(os.path.join(path, name), size, dst) or error
        elif rank == dst:
            failed = _receive(os.path.join(path, name), meta["files"][name], src)
            error, received = failed or error, received + size
    agree(error)
    return received


def _send(path: str, size: int, dst: int) -> CheckpointError | None:
    """Send `size` bytes of `path` in chunks; on a read failure zeros go instead (the
    receiver's checksum fails) so that the pairs of sends and receives stay matched."""
    error = None
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below, whatever happens in between
    except OSError as err:
        f, error = None, CheckpointError(f"cannot read {path} to send it to rank {dst}: {err}")
    try:
        for start in range(0, size, CHUNK_BYTES):
            n = min(CHUNK_BYTES, size - start)
            buf = torch.zeros(n, dtype=torch.uint8)
            if f is not None and error is None:
                data = f.read(n)
                if len(data) != n:
                    error = CheckpointError(f"{path} is shorter than meta.json records; restore it")
                else:
                    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            comm.send(buf, dst)
    finally:
        if f is not None:
            f.close()
    return error


def _receive(path: str, expected: dict, src: int) -> CheckpointError | None:
    """Receive the file into a temporary name; rename it into place only if its size and
    SHA-256 match `expected` (meta.json). Always drains every chunk."""
    size, digest, tmp, error = int(expected["bytes"]), hashlib.sha256(), temp_name(path), None
    try:
        out = open(tmp, "wb")  # noqa: SIM115 - closed below
    except OSError as err:
        out, error = None, CheckpointError(f"cannot write {tmp}: {err}")
    for start in range(0, size, CHUNK_BYTES):
        buf = torch.empty(min(CHUNK_BYTES, size - start), dtype=torch.uint8)
        comm.recv(buf, src)
        data = buf.numpy().tobytes()
        digest.update(data)
        if out is not None and error is None:
            try:
                out.write(data)
            except OSError as err:
                error = CheckpointError(f"cannot write {tmp}: {err}")
    if out is not None:
        try:
            out.flush()
            os.fsync(out.fileno())
        except OSError as err:
            error = error or CheckpointError(f"cannot write {tmp}: {err}")
        out.close()
    if error is None and digest.hexdigest() != expected["sha256"]:
        error = CheckpointError(f"{os.path.basename(path)} sent by rank {src} fails its SHA-256 "
                                "check: its copy on that host is corrupted; restore it or load another tag")
    if error is None:
        os.replace(tmp, path)
    elif os.path.exists(tmp):
        os.remove(tmp)
    return error
