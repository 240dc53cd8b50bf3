"""Measurements the planner's predictions are checked against (tests/planner/test_plan_measured.py,
and the step-time order in benchmarks/planner_order.py):
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

import threading

import torch
import torch.utils.checkpoint as ckpt


def build_engine(model_fields: dict, config: dict, checkpointing: bool):
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


def run_step(engine, batch):
    for x, y in batch:
        engine.backward(engine(x, y))
        engine.step()


def batch_for(engine, model_fields, seq_len):
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
    engine = build_engine(model_fields, config, checkpointing)
    batch = batch_for(engine, model_fields, seq_len)
    run_step(engine, batch)  # the optimizer state exists from here on
    start = engine.memory_breakdown()["total"]
    # Python threads besides this one would have their allocations counted too
    threads = [t.name for t in threading.enumerate() if t is not threading.current_thread()]
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run_step(engine, batch)
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    x, y = batch[0]
    engine.backward(engine(x, y))  # mid-accumulation when gas > 1: gradients are held
    mem = engine.memory_breakdown()
    return {"mem": mem, "peak": start + peak, "start": start, "threads": threads}
