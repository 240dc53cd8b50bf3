"""Run by test_rollcall.py under torchrun: rank 1 ends one step early (issue 9 case 2)
or dies in the middle of training ("die"); rank 0 waits in the next step's collective."""

import os

import torch

import meshspeed
from meshspeed.testing.engines import small_engine, train_step

meshspeed.init_distributed()
torch.set_num_threads(1)
engine = small_engine(0, comms_timeout=30)
rank = int(os.environ["RANK"])
for step in range(4):
    if rank == 1 and step == 3:
        break  # one step early: the peer waits in this step's gradient all-reduce
    train_step(engine, torch.randint(0, 16, (1, 4)))
print(f"rank {rank} finished training", flush=True)
