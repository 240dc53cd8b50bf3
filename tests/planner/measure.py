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
    engines = [(_build(model_fields, config, ck), seq) for config, seq, ck in runs]
    batches = [_batch(engine, model_fields, seq) for engine, seq in engines]
    for (engine, _), batch in zip(engines, batches):
        _step(engine, batch)
    best = [float("inf")] * len(engines)
    for _ in range(rounds):
        for i, ((engine, _), batch) in enumerate(zip(engines, batches)):
            t0 = time.perf_counter()
            _step(engine, batch)
            best[i] = min(best[i], time.perf_counter() - t0)
    return {"calibration": calibrate(), "times": best}
