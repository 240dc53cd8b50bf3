"""Run by test_caller_group.py under torchrun: the script makes the default process group
itself, the way accelerate and torchrun scripts do (`dist.init_process_group("gloo")`, or
`deepspeed.init_distributed()` as accelerate calls it once the group exists), then builds
an engine with `comms_timeout` 3 s. Modes:
- "late": rank 1 skips step 2 and stays alive for 12 s (past the timeout and roll call);
- "dead": rank 1 exits before step 2;
- "clean": both finish; the process group is torn down at exit without a hang or a warning.
"""

import os
import sys
import time

import torch
import torch.distributed as dist

import meshspeed
from meshspeed.testing.engines import small_engine, train_step

mode, maker = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # the deepspeed launcher adds it
dist.init_process_group("gloo")  # the caller's group, before meshspeed is asked anything
if maker == "deepspeed":
    import deepspeed  # the alias (meshspeed run --deepspeed-compat, or meshspeed compat install)

    deepspeed.init_distributed()  # finds the group made above, as under accelerate
torch.set_num_threads(1)
engine = small_engine(0, comms_timeout=3)
rank = dist.get_rank()
for step in range(4):
    if rank == 1 and step == 2 and mode != "clean":
        if mode == "late":
            time.sleep(12)
        os._exit(0)
    train_step(engine, torch.randint(0, 16, (1, 4)))
print(f"rank {rank} finished training", flush=True)
