"""Work per optimizer step of meshspeed at each ZeRO stage, in deterministic units (Note
[work counts] in meshspeed/testing/work.py), on the ZeRO benchmark's GPT (zero.py's
default shape, fp32, 2 gloo ranks x 1 thread), and where rank 0's step spends its Python
time (cProfile, `--profile`):

    .venv/bin/python benchmarks/step_work.py                    # counts at stages 0-3
    .venv/bin/python benchmarks/step_work.py --profile 3 --top 25

Run from another checkout's root with `PYTHONPATH=<that checkout>` to count an older
commit the same way (what docs/benchmarks.md's "Where the step time went" compares).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # siblings, also in spawned ranks

from zero_frameworks import EngineTrainer, Setup, build_model, make_batches  # noqa: E402

from meshspeed.testing import run_distributed  # noqa: E402
from meshspeed.testing.work import count_step_work, engine_step  # noqa: E402


def _engine(setup: Setup, stage: int):
    return EngineTrainer(build_model(setup), setup, stage).engine  # zero.py's own config


def _counts(setup: Setup, stage: int) -> dict:
    torch.set_num_threads(1)
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    engine = _engine(setup, stage)
    return count_step_work(engine_step(engine, make_batches(setup, world, rank, 1)))


def _profile(setup: Setup, stage: int, steps: int, top: int) -> str | None:
    torch.set_num_threads(1)
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    engine = _engine(setup, stage)
    batches = make_batches(setup, world, rank, steps + 2)

    def step(x, y):
        engine.backward(engine(x, y))
        engine.step()

    for x, y in batches[:2]:
        step(x, y)
    prof = cProfile.Profile()
    prof.enable()
    for x, y in batches[2:]:
        step(x, y)
    prof.disable()
    if rank != 0:
        return None
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", default="0,1,2,3", help="ZeRO stages to count")
    ap.add_argument("--profile", type=int, metavar="STAGE", help="cProfile rank 0 at this stage instead")
    ap.add_argument("--steps", type=int, default=10, help="profiled steps")
    ap.add_argument("--top", type=int, default=30, help="functions listed by own time")
    ap.add_argument("--json", help="write the counts here")
    args = ap.parse_args(argv)
    setup = Setup()
    if args.profile is not None:
        print(run_distributed(_profile, 2, args=(setup, args.profile, args.steps, args.top), timeout=600)[0])
        return 0
    rows = {}
    for stage in (int(s) for s in args.stages.split(",")):
        counts = run_distributed(_counts, 2, args=(setup, stage), timeout=600)
        rows[stage] = counts[0]
        print(f"stage {stage}: " + "  ".join(f"{k} {v:,}" for k, v in counts[0].items()), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
