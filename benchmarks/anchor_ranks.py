"""Launching a benchmark's gloo ranks in this venv or in the anchor venv (DeepSpeed 0.19.8's),
for the benchmarks that run both frameworks in the same ranks (ulysses_ds.py, moe.py).

    result = run_degree(__file__, world, plan, tmp)     # the parent: one launch per degree
    spawn_ranks(_rank, world, plan_path, out)           # the script's --worker entry

The anchor venv has torch, DeepSpeed and this checkout on PYTHONPATH; this module imports
only the standard library and torch.multiprocessing, so it loads there too.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ANCHOR_PY = Path("/root/.cache/meshspeed-anchors/bin/python")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def enter_rank(rank: int, world: int, port: int) -> None:
    """A spawned rank's rendezvous variables (torchrun's names) and one intra-op thread."""
    import torch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)


def spawn_ranks(rank_fn: Callable, world: int, plan_path: str, out: str) -> None:
    """`rank_fn(rank, world, port, plan, out)` on `world` spawned processes."""
    import torch.multiprocessing as mp

    plan = json.loads(Path(plan_path).read_text())
    mp.start_processes(rank_fn, args=(world, free_port(), plan, out), nprocs=world, start_method="spawn")


def run_degree(script: str, world: int, plan: dict, tmp: Path) -> dict:
    """Run `script --worker --degree world --plan ... --out ...` (in the anchor venv when
    plan["deepspeed"]) and return the JSON its rank 0 wrote."""
    plan_path, out = tmp / f"plan-{world}.json", tmp / f"result-{world}.json"
    plan_path.write_text(json.dumps(plan))
    python = str(ANCHOR_PY) if plan["deepspeed"] else sys.executable
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu"}
    subprocess.run([python, script, "--worker", "--degree", str(world), "--plan", str(plan_path), "--out", str(out)],
                   check=True, env=env)
    return json.loads(out.read_text())
