"""The planner's predicted order of five layouts' step times against measured CPU runs of
the reference GPT on 2 gloo ranks (fp32, AdamW): a benchmark, not a test, because it
times (docs/planner.md, "Validated against measured runs").

    .venv/bin/python benchmarks/planner_order.py [--rounds 6]

Note [calibration]
This machine is described to the planner by figures measured here, not by defaults.
Links: a gloo all-reduce's bandwidth (4 MiB message) and its latency alpha between pieces
of compute (`calibrate`). Compute: the engine's FLOP/s and its overhead per layer per
micro-batch, solved from two runs that differ only in the micro-batch split (8 x 1 and
1 x 8 at ZeRO 0, both exposing the same all-reduce). The first of them is also the first
of the five ordered layouts; the others are priced with no further fitting. The five were
chosen so that neighbours differ in measurement by 1.4x or more, and are timed
interleaved, best of `--rounds` rounds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshspeed.planner import plan
from meshspeed.planner.cost import Candidate
from meshspeed.testing import run_distributed
from tests.planner.measure import batch_for, build_engine, run_step

SEQ = 64
CALIBRATION = [Candidate(dp=2, micro_batch=8, grad_accum=1), Candidate(dp=2, micro_batch=1, grad_accum=8)]
ORDERED = [
    Candidate(dp=2, micro_batch=8, grad_accum=1),
    Candidate(dp=2, stage=2, micro_batch=2, grad_accum=4),
    Candidate(dp=2, stage=3, micro_batch=1, grad_accum=8),
    Candidate(dp=1, tp=2, micro_batch=1, grad_accum=16, sequence_parallel=False),
    Candidate(dp=1, cp=2, stage=3, checkpointing=True, micro_batch=1, grad_accum=16),
]
TIME_MODEL = {"vocab_size": 256, "max_seq_len": 64, "n_layer": 2, "n_head": 4, "d_model": 128}


def calibrate(small: int = 1 << 15, large: int = 1 << 22, repeats: int = 15) -> dict:
    """The links' figures for the cost model, from 2-rank gloo all-reduces, each the
    median of `repeats` timings. The latency alpha is measured between pieces of compute,
    as training meets it: (matmul + small all-reduce) - matmul alone. On a loaded machine
    that is far more than back-to-back all-reduces show, since each collective waits
    until both ranks are scheduled. The bandwidth comes from the large message."""
    from meshspeed import comm

    torch.set_num_threads(1)
    a, b = torch.randn(256, 128), torch.randn(128, 256)
    small_buf, large_buf = torch.zeros(small // 4), torch.zeros(large // 4)

    def median_time(fn):
        fn()
        comm.barrier()
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples)

    work = median_time(lambda: a @ b)
    with_ar = median_time(lambda: (a @ b, comm.all_reduce(small_buf)))
    big = median_time(lambda: comm.all_reduce(large_buf))
    world = comm.get_world_size()  # 2: the fit below is for two ranks
    # all-reduce of 2 ranks: 2 alpha + bytes / bw (Note [collective times])
    ring = 2 * (world - 1) / world
    bw = ring * large / big
    alpha = max(with_ar - work - ring * small / bw, 1e-6) / 2
    return {"bandwidth": bw, "alpha": alpha}


def step_times(model_fields: dict, runs: list[tuple[dict, int, bool]], rounds: int = 4) -> dict:
    """Seconds per optimizer step of each (config, seq_len, checkpointing): all engines are
    built first, then timed in turn, one step each per round, `rounds` rounds after a
    warm-up step; the minimum over rounds is kept. Interleaving spreads the load of a
    shared machine over every configuration alike, and the minimum is the figure least
    disturbed by it. Also returns the calibration figures."""
    torch.set_num_threads(1)
    engines = [(build_engine(model_fields, config, ck), seq) for config, seq, ck in runs]
    batches = [batch_for(engine, model_fields, seq) for engine, seq in engines]
    for (engine, _), batch in zip(engines, batches):
        run_step(engine, batch)
    best = [float("inf")] * len(engines)
    for _ in range(rounds):
        for i, ((engine, _), batch) in enumerate(zip(engines, batches)):
            t0 = time.perf_counter()
            run_step(engine, batch)
            best[i] = min(best[i], time.perf_counter() - t0)
    return {"calibration": calibrate(), "times": best}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6, help="timed rounds; the best of each is kept")
    args = ap.parse_args(argv)
    probe = plan(TIME_MODEL, 2, "1GB", global_batch=16, seq_len=SEQ, gpus_per_node=2, precision="fp32")
    layouts = CALIBRATION + ORDERED
    runs = [(probe.price(c).to_config(), SEQ, c.checkpointing) for c in layouts]
    ranks = run_distributed(step_times, 2, args=(TIME_MODEL, runs, args.rounds), timeout=600)
    measured = [max(t) for t in zip(*(r["times"] for r in ranks))]
    cal = ranks[0]["calibration"]
    kw = {"global_batch": 16, "seq_len": SEQ, "gpus_per_node": 2, "precision": "fp32",
          "mfu": 1.0, "overlap": 0.0,  # gloo on busy cores: nothing overlaps
          "link": {"intra": cal["bandwidth"], "inter": cal["bandwidth"]},
          "latency": {"intra": cal["alpha"], "inter": cal["alpha"]}}
    unit = plan(TIME_MODEL, 2, "1GB", peak_flops=1.0, **kw)  # compute = FLOPs, in "seconds"
    one = unit.price(CALIBRATION[0]).time  # the 1 x 8 run differs only in compute overhead
    comm_time = one["total"] - one["compute"]
    layers = TIME_MODEL["n_layer"]
    overhead = max(0.0, (measured[1] - measured[0]) / (layers * 7))
    flops = one["compute"] / max(measured[0] - comm_time - layers * overhead, 1e-6)
    fitted = plan(TIME_MODEL, 2, "1GB", peak_flops=flops, layer_overhead=overhead, **kw)
    predicted = [fitted.price(c).step_time for c in ORDERED]
    got = measured[len(CALIBRATION):]
    print("| layout | predicted ms | measured ms |\n|---|---|---|")
    for c, p, m in zip(ORDERED, predicted, got):
        print(f"| {c.label()} | {p * 1e3:.1f} | {m * 1e3:.1f} |")
    same = sorted(range(5), key=predicted.__getitem__) == sorted(range(5), key=got.__getitem__)
    print(f"predicted order {'equals' if same else 'differs from'} the measured order")
    return 0


if __name__ == "__main__":
    sys.exit(main())
