"""A job that only waits, for the launch tests: each rank prints `up` and sleeps.

    ranks_wait.py [--fail-rank R] [--sleep S]

Rank R (if given) exits with status 3 instead, so that its host fails; the others sleep S
seconds (default 300).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("--fail-rank", type=int, default=-1)
parser.add_argument("--sleep", type=float, default=300.0)
args = parser.parse_args()
rank = int(os.environ["RANK"])
print(f"up (pid {os.getpid()})", flush=True)
if rank == args.fail_rank:
    time.sleep(2)
    sys.exit(3)
time.sleep(args.sleep)
