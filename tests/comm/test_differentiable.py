"""The differentiable collectives against autograd of the whole computation on one
process (Note [what the backward of a collective means]), at world sizes 2 and 4.

Every rank builds the same full tensors from a fixed seed; rank r's loss uses weights W_r
that differ per rank, so a backward that forgot to sum (or summed where it must not)
gives a different gradient."""

from __future__ import annotations

import torch
from torch.testing import assert_close

from meshspeed import comm
from meshspeed.testing import run_distributed, world_sizes
from meshspeed.testing.slow_comm import SlowLink

B, T, D = 2, 8, 3  # T divides by 4: the sequence dim (1) is split


def _weights(n: int, shape) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(shape, generator=g) for _ in range(n)]


def _full(shape) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(2))


def _pairs_body(dim: int):
    n, r = comm.get_world_size(), comm.get_rank()
    group = None
    shape = (B, T, D)
    X = _full(shape)
    Ws = _weights(n, shape)
    shard = lambda t: t.chunk(n, dim)[r]

    # copy_to_parallel: x replicated, per-rank losses; reference L = sum_r (X W_r).
    x = X.clone().requires_grad_()
    y = comm.copy_to_parallel(x, group)
    assert_close(y, X)
    (y * Ws[r]).sum().backward()
    ref = X.clone().requires_grad_()
    sum((ref * w).sum() for w in Ws).backward()
    assert_close(x.grad, ref.grad)

    # reduce_from_parallel: x_r partial, sum replicated, one replicated loss (same W).
    parts = _weights(n, shape)
    x = parts[r].clone().requires_grad_()
    y = comm.reduce_from_parallel(x, group)
    refs = [p.clone().requires_grad_() for p in parts]
    ref_y = sum(refs)
    assert_close(y, ref_y)
    (y * Ws[0]).sum().backward()
    (ref_y * Ws[0]).sum().backward()
    assert_close(x.grad, refs[r].grad)

    # all_gather_sequence: x_r a shard of X, per-rank losses on the gathered whole.
    x = shard(X).clone().requires_grad_()
    y = comm.all_gather_sequence(x, group, dim)
    assert_close(y, X)
    (y * Ws[r]).sum().backward()
    ref = X.clone().requires_grad_()
    sum((ref * w).sum() for w in Ws).backward()
    assert_close(x.grad, shard(ref.grad))

    # reduce_scatter_sequence: x_r a whole-size partial; rank r's loss on its shard.
    x = parts[r].clone().requires_grad_()
    y = comm.reduce_scatter_sequence(x, group, dim)
    refs = [p.clone().requires_grad_() for p in parts]
    total = sum(refs)
    assert_close(y, shard(total))
    (y * shard(Ws[r])).sum().backward()
    sum((t * w.chunk(n, dim)[i]).sum() for i, (t, w) in enumerate(zip(total.chunk(n, dim), Ws))).backward()
    assert_close(x.grad, refs[r].grad)

    # scatter_to_parallel: x replicated, rank r keeps its piece, per-rank losses.
    x = X.clone().requires_grad_()
    y = comm.scatter_to_parallel(x, group, dim)
    assert_close(y, shard(X))
    (y * shard(Ws[r])).sum().backward()
    ref = X.clone().requires_grad_()
    sum((p * w.chunk(n, dim)[i]).sum() for i, (p, w) in enumerate(zip(ref.chunk(n, dim), Ws))).backward()
    assert_close(x.grad, ref.grad)

    # gather_from_parallel: pieces gathered into a replicated whole, one replicated loss.
    x = shard(X).clone().requires_grad_()
    y = comm.gather_from_parallel(x, group, dim)
    assert_close(y, X)
    (y * Ws[0]).sum().backward()
    ref = X.clone().requires_grad_()
    (ref * Ws[0]).sum().backward()
    assert_close(x.grad, shard(ref.grad))
    if dim == 1:
        _all_to_all_checks(n, r, group)
    return True


def _all_to_all_checks(n: int, r: int, group) -> None:
    """all_to_all, equal and uneven blocks: rank j sends sends[j][i] rows of X_j to rank i
    (some zero); per-rank losses on what each rank receives."""
    from meshspeed.comm.differentiable import all_to_all

    for uneven in (False, True):
        sends = [[(j + 2 * i) % 3 if uneven else 2 for i in range(n)] for j in range(n)]
        Xs = [torch.randn(sum(sends[j]), D, generator=torch.Generator().manual_seed(10 + j)) for j in range(n)]
        refs = [X.clone().requires_grad_() for X in Xs]
        outs = [torch.cat([refs[j][sum(sends[j][:i]):sum(sends[j][:i + 1])] for j in range(n)]) for i in range(n)]
        Ws = [torch.randn(o.shape, generator=torch.Generator().manual_seed(20 + i)) for i, o in enumerate(outs)]
        sum((o * w).sum() for o, w in zip(outs, Ws)).backward()
        x = Xs[r].clone().requires_grad_()
        splits = ([sends[j][r] for j in range(n)], sends[r]) if uneven else (None, None)
        y = all_to_all(x, group, *splits)
        assert torch.equal(y, outs[r])
        (y * Ws[r]).sum().backward()
        assert torch.equal(x.grad, refs[r].grad)
    for bad in ((None, [1] * n), ([1] * n, [1] * (n + 1)), ([1] * n, [1] * n)):
        try:
            all_to_all(torch.zeros(n + 1, D), group, *bad)
        except ValueError as err:
            assert "all_to_all" in str(err)
        else:
            raise AssertionError(f"all_to_all accepted splits {bad}")


@world_sizes(2, 4)
def test_pairs_match_autograd_of_the_whole(world_size):
    for dim in (1, 0, -1):
        if (B, T, D)[dim] % world_size:
            continue
        assert all(run_distributed(_pairs_body, world_size, args=(dim,)))


def _blocked_body():
    delay = 0.02
    with SlowLink(delay), comm.BlockedTimer() as blocked:
        t = torch.ones(4)
        for _ in range(3):
            comm.all_reduce(t, async_op=True).wait()  # waited at once: all exposed
        comm.all_reduce(t)  # synchronous: counted too
    assert set(blocked.by_op) == {"all_reduce"}
    assert blocked.seconds >= 3 * delay
    with comm.BlockedTimer() as idle:
        pass
    return idle.seconds == 0.0


def test_blocked_timer_counts_waits_and_synchronous_calls():
    assert all(run_distributed(_blocked_body, 2))
