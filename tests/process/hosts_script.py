"""A 4-rank training script with `checkpoint.auto_resume` and a short `comms_timeout`,
started on 2 namespaced hosts by test_hosts.py (and, uninterrupted, through the test
harness). Each step sleeps a little so a test can kill or cut a host mid-run.

Rank 0 appends "attempt A step S loss L" per optimizer step to log-rank0.txt, and writes
the final parameters to final.pt."""

from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # run as a script by the launcher
import restart_script

TOTAL, EVERY = 12, 3  # optimizer steps, checkpoint interval
SAMPLES = 32
PAUSE_S = 0.4  # per step, so that a host can be killed mid-run
PAUSE_ALONE_S = 4.0  # per step while 2 ranks start alone: the other host joins meanwhile
COMMS_TIMEOUT_S = 20


def train(out_dir: str, pause: float = PAUSE_S, kill_at: int = -1) -> None:
    """`kill_at` >= 0: rank 3 kills itself (SIGKILL) mid-step `kill_at`, once."""

    def wait(engine, attempt: str) -> None:
        alone = torch.distributed.get_world_size() == 2 and attempt == "0"
        time.sleep(PAUSE_ALONE_S if alone and pause else pause)

    restart_script.run(out_dir, kill_at, total=TOTAL, every=EVERY, samples=SAMPLES, killer=3,
                       comms_timeout=COMMS_TIMEOUT_S, after_step=wait)


if __name__ == "__main__":
    train(sys.argv[1], PAUSE_S, int(sys.argv[2]) if len(sys.argv) > 2 else -1)
