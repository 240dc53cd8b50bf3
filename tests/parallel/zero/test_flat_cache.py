"""Note [gathered buffers without fresh pages] (meshspeed/parallel/zero/flat_cache.py): a
released stage-3 unit's memory is kept, within a budget, for the next gather of its size;
training is bit for bit that without the cache, and the units' storages, which autograd's
saved views share, stay the same objects."""

import torch

from meshspeed.models.gpt import GPTConfig
from meshspeed.parallel.zero.flat_cache import FlatCache
from meshspeed.testing import run_distributed
from meshspeed.testing.engines import small_engine
from meshspeed.testing.parity import full_state_dict

CFG = GPTConfig(vocab_size=64, max_seq_len=8, n_layer=3, n_head=2, d_model=32)


def test_a_spare_moves_its_memory_into_the_next_storage_of_its_size():
    cache = FlatCache(budget_bytes=3 * 4096)
    a = torch.arange(1024, dtype=torch.float32)
    storage, ptr = a.untyped_storage(), a.data_ptr()
    view = a[10:20]  # a view, as autograd saves
    cache.empty(storage)
    assert storage.nbytes() == 0 and cache.bytes == 4096
    cache.fill(storage, 4096)
    assert (storage.nbytes(), a.data_ptr(), cache.hits, cache.bytes) == (4096, ptr, 1, 0)
    assert torch.equal(view, torch.arange(10, 20, dtype=torch.float32))  # the same memory again
    # another size is a new allocation; past the budget the oldest spare is freed
    b = torch.empty(2048)
    cache.fill(b.untyped_storage(), 2 * 4096)
    assert cache.hits == 1
    for t in (a, b, torch.empty(1024)):
        cache.empty(t.untyped_storage())
    assert cache.bytes == 3 * 4096  # a's spare went, b's and the last one's stayed
    assert sorted(s.nbytes() for s in cache._spares) == [4096, 8192]
    # larger than the budget: freed at once
    big = torch.empty(4096)
    cache.empty(big.untyped_storage())
    assert big.untyped_storage().nbytes() == 0 and cache.bytes <= cache.budget_bytes


def _train(use_cache: bool):
    torch.manual_seed(0)
    engine = small_engine(3, cfg=CFG, zero_optimization={"stage": 3, "stage3_param_persistence_threshold": 0})
    strategy = engine.strategy
    if not use_cache:
        for unit in strategy.units:
            unit.flat_cache = None
    storages = [u.flat.untyped_storage()._cdata for u in strategy.units]
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        x = torch.randint(0, CFG.vocab_size, (1, 8), generator=g)
        loss = engine(x, x)
        engine.backward(loss)
        held = (strategy.flat_cache.bytes, engine.memory_breakdown()["comm_buffers"])
        engine.step()
        losses.append(loss.item())
    cache = strategy.flat_cache
    mem = engine.memory_breakdown()
    same = storages == [u.flat.untyped_storage()._cdata for u in strategy.units]  # (before the
    # gather for the user below, which moves the units to new buffers)
    return {"losses": losses, "params": full_state_dict(engine),
            "same_storages": same,
            "hits": cache.hits if use_cache else 0, "bytes": cache.bytes, "budget": cache.budget_bytes,
            "held_before_step": held, "comm_buffers": mem["comm_buffers"]}


def _both():
    return _train(True), _train(False)


def test_training_with_the_cache_is_training_without_it():
    for cached, plain in run_distributed(_both, world_size=2):
        assert cached["losses"] == plain["losses"]
        for name, value in plain["params"].items():
            assert torch.equal(cached["params"][name], value), name
        assert cached["same_storages"]
        assert cached["hits"] > 0, "no gather was served from a spare"
        # after the backward the last released unit's buffer is kept, counted in
        # memory_breakdown; from the step on, nothing is
        held, comm_buffers = cached["held_before_step"]
        assert 0 < held <= cached["budget"]
        assert comm_buffers == plain["held_before_step"][1] + held
        assert cached["bytes"] == 0 and cached["comm_buffers"] == plain["comm_buffers"]
