"""A training script for test_node_local_hosts.py, launched by torchrun on each host.

    node_local_train.py SAVE_DIR OUT.json --steps 4 [--save-at 2 ...] [--resume] [--auto-resume]
        [--stage 2] [--no-key] [--full-disk-rank R]

Trains steps [first, steps) of tests/checkpoint/workers.py's setup (first: 0, or the loaded
checkpoint's step), saving at `--save-at`; rank 0 writes {"losses", "loaded", "error"} to
OUT.json. A CheckpointError is caught and written there (the script then exits 3)."""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

torch.set_num_threads(1)

from meshspeed import comm
from meshspeed.checkpoint import CheckpointError
from tests.checkpoint import workers


def _fill_disk() -> None:
    import errno

    from meshspeed.checkpoint import tensorfile

    def full(f, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    tensorfile._write_chunk = full


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("save_dir")
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--save-at", type=int, action="append", default=[])
    p.add_argument("--resume", action="store_true")
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--no-key", action="store_true")
    p.add_argument("--auto-resume", action="store_true")
    p.add_argument("--full-disk-rank", type=int, default=None,
                   help="this rank's disk is full from the second save on")
    a = p.parse_args()
    extra = {} if a.no_key else {"checkpoint": {"use_node_local_storage": True,
                                                "auto_resume": a.auto_resume}}
    world = int(os.environ["WORLD_SIZE"])
    setup = workers.setup_for(world, a.stage, steps=a.steps, extra_config=extra)
    engine = workers.make_engine(setup)
    out = {"losses": [], "loaded": None, "error": None, "world": world}
    status = 0
    try:
        if a.resume:
            path, _ = engine.load_checkpoint(a.save_dir)
            out["loaded"] = path
        first = engine.global_steps
        for step in range(first, a.steps):
            out["losses"] += workers.train(engine, setup, step, step + 1)
            if step + 1 in a.save_at:
                if a.full_disk_rank == comm.get_rank() and step + 1 > min(a.save_at):
                    _fill_disk()
                engine.save_checkpoint(a.save_dir)
    except CheckpointError as err:
        out["error"], status = str(err), 3
    if comm.get_rank() == 0:
        with open(a.out, "w", encoding="utf-8") as f:
            json.dump(out, f)
    return status


if __name__ == "__main__":
    sys.exit(main())
