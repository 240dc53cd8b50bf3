"""Cost of the step agreement (Note [agreement before each step] in meshspeed/engine/agreement.py):
the time of one `agree` call on 2 gloo ranks of this machine, plus the bookkeeping every
collective pays for the digest the agreement compares (Note [collective digest]) times the
collectives of one step, as a share of a step of the benchmark GPT (the `default` shape of
zero.py, about 0.36 s a step here; it issues 21 collectives a step at stages 1-2 and 20 at
stage 3, measured; the default of 40 is twice that).

    .venv/bin/python benchmarks/agreement.py [--calls 500] [--step-s 0.36] [--collectives 40]
"""

from __future__ import annotations

import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, world: int, port: int, calls: int, step_s: float, collectives: int) -> None:
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
    from meshspeed.comm import sequence

    x = torch.ones(1024)
    start = time.perf_counter()
    for _ in range(20000):
        sequence.record("all_gather", None, x, True)
    per_record = (time.perf_counter() - start) / 20000
    per_step = per_call + collectives * per_record
    if rank == 0:
        print(f"agree: {per_call * 1e6:.0f} us per call over {calls} calls; digest bookkeeping "
              f"{per_record * 1e6:.2f} us per collective; with {collectives} collectives a step "
              f"{per_step * 1e6:.0f} us = {100 * per_step / step_s:.2f}% of a {step_s} s step")
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--step-s", type=float, default=0.36, help="the step time to compare with")
    ap.add_argument("--collectives", type=int, default=40, help="collectives issued in one step")
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(2, port, args.calls, args.step_s, args.collectives), nprocs=2)


if __name__ == "__main__":
    main()
