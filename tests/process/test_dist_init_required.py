"""`dist_init_required=False` without a process group: an error, on every path DeepSpeed
scripts take (`deepspeed.init_distributed`, `deepspeed.initialize`), never a silent return
that leaves the ranks waiting. Runs in a clean subprocess, bounded by a timeout."""

import os
import subprocess
import sys

_SCRIPT = """
import torch, torch.distributed as dist
from meshspeed.compat.api import initialize
from meshspeed.process.distributed import ProcessGroupMissingError, init_distributed
for call in (lambda: init_distributed("gloo", dist_init_required=False),
             lambda: initialize(model=torch.nn.Linear(2, 2), dist_init_required=False,
                                config={"train_micro_batch_size_per_gpu": 1})):
    try:
        call()
    except AssertionError as err:
        assert isinstance(err, ProcessGroupMissingError) and not dist.is_initialized()
        print(str(err).split(":")[0])
    else:
        raise SystemExit("returned without a process group")
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
init_distributed("gloo", dist_init_required=False)  # the caller's group: adopted
print(dist.get_world_size())
dist.destroy_process_group()
"""


def test_dist_init_required_false_without_a_group_raises():
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    result = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True,
                            text=True, timeout=90, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    said = "dist_init_required=False but torch.distributed has no process group"
    assert result.stdout.split("\n")[:3] == [said, said, "1"]
