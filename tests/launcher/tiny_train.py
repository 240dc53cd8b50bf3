"""A tiny GPT trained at ZeRO-3 (fp32, gloo) under `meshspeed run`, for the launch tests.

    tiny_train.py OUT [--sleep S]

Every rank prints its loss per step (`loss 4.1588`); rank 0 saves (losses, parameters)
to OUT. With --sleep it then waits S seconds, so that a test can interrupt a running job.
"""

from __future__ import annotations

import argparse
import time

import torch

import meshspeed
from meshspeed.testing.parity import ParitySetup, engine_run

SETUP = ParitySetup(world=4, stage=3, steps=3)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--sleep", type=float, default=0.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    meshspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    losses, state = engine_run(SETUP)
    for loss in losses:
        print(f"loss {loss:.6f}", flush=True)
    if torch.distributed.get_rank() == 0:
        torch.save((losses, state), args.out)
    time.sleep(args.sleep)


if __name__ == "__main__":
    main()
