"""Run by test_timeout.py in a fresh process tree: rank 1 skips a collective that rank 0
waits in, staying alive for `linger` seconds (past the 3 s timeout and the 5 s roll call) or exiting at once;
rank 0 must fail with a CommError that names the collective."""

import os
import sys

import torch
import torch.multiprocessing as mp


def rank_main(rank: int, port: int, out_dir: str, linger: float) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_RANK=str(rank))
    import meshspeed
    from meshspeed import comm

    meshspeed.init_distributed(timeout=3)
    comm.all_reduce(torch.ones(2))  # both ranks: #0
    result = "no error"
    if rank == 0:
        try:
            comm.all_reduce(torch.ones(2))  # #1: rank 1 never joins
        except Exception as err:  # noqa: BLE001 - reported to the test
            result = f"{type(err).__name__}: {err}"
    else:
        import time

        time.sleep(linger)  # alive (timeout) or gone at once (a dead peer)
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
        f.write(result)
    os._exit(0)  # the group is broken by design: skip teardown


if __name__ == "__main__":
    mp.spawn(rank_main, args=(int(sys.argv[1]), sys.argv[2], float(sys.argv[3])), nprocs=2)
