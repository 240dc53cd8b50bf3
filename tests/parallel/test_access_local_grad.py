"""`safe_get_full_grad` before the step's reduction at stage 0 and ZeRO 1 (inside
`engine.no_sync()`): this rank's own accumulated gradient, as DeepSpeed's `param.grad`
(Note [local gradients before the reduction] in meshspeed/parallel/access.py); and
`engine.zero_grad()` drops it, as DeepSpeed's."""

import pytest
import torch

from meshspeed.testing import run_distributed


def _local_grads(stage):
    from meshspeed.utils import safe_get_full_grad, safe_get_local_grad

    from meshspeed import comm
    from meshspeed.models.gpt import GPT
    from meshspeed.testing.engines import TINY, small_engine

    torch.set_num_threads(1)
    engine = small_engine(stage)
    torch.manual_seed(0)
    reference = GPT(TINY)  # the same weights, one process
    g = torch.Generator().manual_seed(comm.get_rank())
    a, b = (torch.randint(0, 16, (1, 4), generator=g) for _ in range(2))
    (reference(a, a) + reference(b, b)).backward()
    want = {n: p.grad.clone() for n, p in reference.named_parameters()}
    named = dict(engine.module.named_parameters())
    dropped = []
    before = [safe_get_full_grad(p) for p in named.values()]
    local = []
    for _ in range(2):  # engine.zero_grad() between the blocks drops the first one's gradients
        with engine.no_sync():
            engine.backward(engine(a, a))
            engine.backward(engine(b, b))
            local.append({n: safe_get_full_grad(p) for n, p in named.items()})
            flat = {n: safe_get_local_grad(p) for n, p in named.items()}
        if not dropped:
            engine.zero_grad()
            dropped = [safe_get_full_grad(p) for p in named.values()]
    engine.backward(engine(a, a))  # the boundary: reduces what the block accumulated
    reduced = {n: safe_get_full_grad(p) for n, p in named.items()}
    return before + dropped, local, flat, want, reduced


@pytest.mark.parametrize("stage", [0, 1])
def test_inside_no_sync_the_full_grad_is_this_ranks_own(stage):
    ranks = run_distributed(_local_grads, world_size=2, args=(stage,), timeout=90)
    for nones, (first, second), flat, want, _ in ranks:
        assert nones == [None] * len(nones)  # before any backward, and after zero_grad()
        for name, grad in want.items():
            torch.testing.assert_close(first[name], grad, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(second[name], first[name], rtol=0, atol=0)
            torch.testing.assert_close(flat[name], grad.reshape(-1), rtol=1e-5, atol=1e-6)
    (_, (local0, _), _, _, reduced0), (_, (local1, _), _, _, reduced1) = ranks
    name = "head.weight" if "head.weight" in local0 else next(iter(local0))
    assert not torch.allclose(local0[name], local1[name])  # unreduced: each rank's own batches
    for n in reduced0:  # after the boundary backward: the average, the same on both ranks
        torch.testing.assert_close(reduced0[n], reduced1[n], rtol=0, atol=0)
