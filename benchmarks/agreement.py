"""Cost of the step agreement (Note [agreement before each step] in meshspeed/engine/agreement.py):
the time of one `agree` call on 2 gloo ranks of this machine, as a share of a step of the
benchmark GPT (the `default` shape of zero.py, about 0.36 s a step here).

    .venv/bin/python benchmarks/agreement.py [--calls 500] [--step-s 0.36]
"""

from __future__ import annotations

import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, world: int, port: int, calls: int, step_s: float) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from meshspeed.engine.agreement import STEP_COUNTERS, agree

    counters = dict.fromkeys(STEP_COUNTERS, 5)
    for _ in range(50):  # warm-up
        agree("a step", counters)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        agree("a step", counters)
    per_call = (time.perf_counter() - start) / calls
    if rank == 0:
        print(f"agree: {per_call * 1e6:.0f} us per call over {calls} calls, "
              f"{100 * per_call / step_s:.2f}% of a {step_s} s step")
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--step-s", type=float, default=0.36, help="the step time to compare with")
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(2, port, args.calls, args.step_s), nprocs=2)


if __name__ == "__main__":
    main()
