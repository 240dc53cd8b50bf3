"""Minor page faults, kernel time and CPU time per optimizer step of meshspeed at one ZeRO
stage, on the ZeRO benchmark's GPT (zero.py's default shape and EngineTrainer, fp32, 2 gloo
ranks x 1 thread); rank 0's figures, from getrusage around the timed loop. Also the
workload py-spy profiles in docs/benchmarks.md ("Where the step time went"):

    .venv/bin/python benchmarks/step_faults.py STAGE [STEPS]
    py-spy record --subprocesses --native -r 100 -f raw -o spy.txt -- \\
        .venv/bin/python benchmarks/step_faults.py STAGE 20
    .venv/bin/python benchmarks/spy_summary.py spy.txt

Run from another checkout's root with `PYTHONPATH=<that checkout>` to measure an older commit.
"""

from __future__ import annotations

import os
import resource
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # siblings, also in spawned ranks

from zero_frameworks import EngineTrainer, Setup, build_model, make_batches  # noqa: E402

from meshspeed.testing import run_distributed  # noqa: E402


def timed_steps(t: EngineTrainer, batches, steps: int) -> None:
    for i in range(steps):  # the loop spy_summary.py reads (its frame is `timed_steps`)
        x, y = batches[i % len(batches)]
        t.backward(t.forward(x, y))
        t.optimizer_step()


def work(stage: int, steps: int) -> dict[str, float]:
    torch.set_num_threads(1)
    setup = Setup()
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    batches = make_batches(setup, world, rank, 4)
    trainer = EngineTrainer(build_model(setup), setup, stage)
    timed_steps(trainer, batches, 3)  # warm-up
    r0, c0, w0 = resource.getrusage(resource.RUSAGE_SELF), time.process_time(), time.perf_counter()
    timed_steps(trainer, batches, steps)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    return {"minor_faults": (r1.ru_minflt - r0.ru_minflt) / steps, "sys_ms": 1e3 * (r1.ru_stime - r0.ru_stime) / steps,
            "cpu_ms": 1e3 * (time.process_time() - c0) / steps, "wall_ms": 1e3 * (time.perf_counter() - w0) / steps}


if __name__ == "__main__":
    stage = int(sys.argv[1])
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 10
    result = run_distributed(work, 2, args=(stage, steps))[0]
    print(f"stage {stage}: " + "  ".join(f"{k} {v:,.1f}" for k, v in result.items()), flush=True)
