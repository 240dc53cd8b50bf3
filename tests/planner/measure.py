"""Measurements the planner's predictions are checked against (tests/planner/test_plan_measured.py):
run on gloo ranks through meshspeed.testing.run_distributed, one engine per configuration.

Note [measured peak]
CPU tensors have no allocator statistics like torch.cuda.max_memory_allocated, so the peak
is measured as: the bytes the engine's tensors hold at the start of a step
(memory_breakdown(), counted from their storages) plus the highest running sum of the CPU
allocations minus frees during that step's forward, backward and optimizer step, as the
torch profiler records every allocation (profile_memory=True). That is the allocator-level
peak of torch tensor memory: no fragmentation, no interpreter.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.utils.checkpoint as ckpt


def _build(model_fields: dict, config: dict, checkpointing: bool):
    import meshspeed
    from meshspeed.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(**model_fields))
    if checkpointing:  # the model's side of activation checkpointing: each block recomputed
        for block in model.layers:
            block.forward = _recomputed(block.forward)
    config = {**config, "steps_per_print": 10**6}
    engine, *_ = meshspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _recomputed(forward):
    def run(x):
        return ckpt.checkpoint(forward, x, use_reentrant=False)
    return run


def _step(engine, batch):
    for x, y in batch:
        engine.backward(engine(x, y))
        engine.step()


def _batch(engine, model_fields, seq_len):
    from meshspeed import comm

    g = torch.Generator().manual_seed(comm.get_rank())
    mb, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    tokens = torch.randint(0, model_fields["vocab_size"], (gas, mb, seq_len + 1), generator=g)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def states_and_peak(model_fields: dict, config: dict, seq_len: int, checkpointing: bool) -> dict:
    """Model-state bytes mid-accumulation (gradients held, as the planner counts them) and
    the measured peak of one step, Note [measured peak]."""
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(1)
    engine = _build(model_fields, config, checkpointing)
    batch = _batch(engine, model_fields, seq_len)
    _step(engine, batch)  # the optimizer state exists from here on
    start = engine.memory_breakdown()["total"]
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        _step(engine, batch)
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    x, y = batch[0]
    engine.backward(engine(x, y))  # mid-accumulation when gas > 1: gradients are held
    mem = engine.memory_breakdown()
    return {"mem": mem, "peak": start + peak, "start": start}


def calibrate(sizes=(256, 512), nbytes=(1 << 12, 1 << 21), repeats=5) -> dict:
    """This machine's figures for the cost model: FLOP/s of one rank's matmul (both ranks
    computing at once, as in training) and the alpha-beta fit of a 2-rank gloo
    all-reduce from a small and a large message."""
    from meshspeed import comm

    torch.set_num_threads(1)
    n = max(sizes)
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    comm.barrier()
    t0 = time.perf_counter()
    for _ in range(repeats):
        a @ b
    flops = 2 * n**3 * repeats / (time.perf_counter() - t0)
    times = []
    for size in nbytes:
        buf = torch.zeros(size // 4)
        comm.all_reduce(buf)
        comm.barrier()
        t0 = time.perf_counter()
        for _ in range(repeats):
            comm.all_reduce(buf)
        times.append((time.perf_counter() - t0) / repeats)
    world = comm.get_world_size()
    # ring all-reduce: 2 (n-1) alpha + 2 (n-1)/n bytes / bw
    ring = 2 * (world - 1) / world
    bw = ring * (nbytes[1] - nbytes[0]) / max(times[1] - times[0], 1e-9)
    alpha = max(times[0] - ring * nbytes[0] / bw, 1e-6) / (2 * (world - 1))
    return {"flops": flops, "bandwidth": bw, "alpha": alpha}


def step_times(model_fields: dict, runs: list[tuple[dict, int, bool]], steps: int = 3) -> dict:
    """Median seconds per optimizer step of each (config, seq_len, checkpointing), after
    one warm-up step; plus the calibration figures."""
    torch.set_num_threads(1)
    out = {"calibration": calibrate(), "times": []}
    for config, seq_len, checkpointing in runs:
        engine = _build(model_fields, config, checkpointing)
        batch = _batch(engine, model_fields, seq_len)
        _step(engine, batch)
        samples = []
        for _ in range(steps):
            t0 = time.perf_counter()
            _step(engine, batch)
            samples.append(time.perf_counter() - t0)
        out["times"].append(statistics.median(samples))
    return out
