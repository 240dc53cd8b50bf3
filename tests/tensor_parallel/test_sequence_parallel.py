"""Sequence parallelism (arXiv:2205.05198) in a small pre-norm block, norm -> column ->
gelu -> row -> dropout -> residual: parity with one process, partial norm gradients,
saved activation bytes (1/t in the norm/dropout region), communication bytes equal to
plain TP's, one gather for q/k/v siblings, and overlap that does not change results even
on a slow link. World sizes 2 and 4 (4 where cheap), fp32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

from meshspeed import comm
from meshspeed.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    SharedGather,
    mark_sequence_parallel,
    partial_grad_params,
)
from meshspeed.testing import run_distributed, world_sizes
from meshspeed.testing.slow_comm import SlowLink
from tests.tensor_parallel._reference import ATOL, RTOL, assert_shard_matches, seq_shard

B, T, D, H = 2, 8, 4, 8


class Block(nn.Module):
    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.up = nn.Linear(D, H)
        self.down = nn.Linear(H, D)
        self.p = p

    def forward(self, x, saved=None):
        with _region(saved):
            h = self.norm(x)
        h = self.down(F.gelu(self.up(h)))
        with _region(saved):
            h = F.dropout(h, self.p, self.training)
        return x + h


class _region:
    """Counts the bytes of activations (not parameters) saved for backward inside."""

    def __init__(self, saved):
        self.saved = saved

    def __enter__(self):
        if self.saved is not None:
            self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
            self.hooks.__enter__()

    def _pack(self, t):
        if not isinstance(t, nn.Parameter):
            self.saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    def __exit__(self, *exc):
        if self.saved is not None:
            self.hooks.__exit__(*exc)


def _parallel(ref: Block, sp: bool, chunks: int = 1, save_gathered: bool = False) -> Block:
    block = Block(ref.p)
    block.load_state_dict(ref.state_dict())
    block.up = ColumnParallelLinear.from_module(ref.up, None, sequence_parallel=sp,
                                                overlap_chunks=chunks,
                                                save_gathered_input=save_gathered)
    block.down = RowParallelLinear.from_module(ref.down, None, sequence_parallel=sp,
                                               overlap_chunks=chunks)
    if sp:
        mark_sequence_parallel(block.norm)
    return block


def _data():
    g = torch.Generator().manual_seed(21)
    return torch.randn(B, T, D, generator=g), torch.randn(B, T, D, generator=g)


def _run(block: Block, sp: bool, saved=None):
    X, W = _data()
    x = (seq_shard(X) if sp else X).clone().requires_grad_()
    out = block(x, saved)
    (out * (seq_shard(W) if sp else W)).sum().backward()
    return out.detach(), x.grad


def _block_parity_body():
    torch.manual_seed(20)
    ref = Block()
    ref_out, ref_x = _run(ref, False)
    for sp in (False, True):
        for chunks in (1, 2):
            block = _parallel(ref, sp, chunks)
            out, gx = _run(block, sp)
            assert_close(out, seq_shard(ref_out) if sp else ref_out, rtol=RTOL, atol=ATOL)
            assert_close(gx, seq_shard(ref_x) if sp else ref_x, rtol=RTOL, atol=ATOL)
            partial = partial_grad_params(block)
            assert ({id(p) for p in partial} == {id(block.norm.weight), id(block.norm.bias),
                                                 id(block.down.bias)}) == sp
            for p in partial:  # what the engine does once per step
                comm.all_reduce(p.grad)
            for name in ("norm.weight", "norm.bias", "down.bias"):
                assert_close(block.get_parameter(name).grad, ref.get_parameter(name).grad,
                             rtol=RTOL, atol=ATOL)
            assert_shard_matches(block.up.weight.grad, block.up.tp_shards["weight"], ref.up.weight.grad)
            assert_shard_matches(block.down.weight.grad, block.down.tp_shards["weight"],
                                 ref.down.weight.grad)
    return True


@world_sizes(2, 4)
def test_block_parity_and_partial_norm_gradients(world_size):
    assert all(run_distributed(_block_parity_body, world_size))


def _memory_and_bytes_body():
    n = comm.get_world_size()
    torch.manual_seed(20)
    ref = Block(p=0.1)
    sizes, traffic = {}, {}
    for sp in (False, True):
        saved: dict[int, int] = {}
        block = _parallel(ref, sp)
        X, W = _data()
        x = (seq_shard(X) if sp else X).clone().requires_grad_()
        with comm.CommCounter() as fwd:
            out = block(x, saved)
        with comm.CommCounter() as bwd:
            (out * (seq_shard(W) if sp else W)).sum().backward()
        sizes[sp] = sum(saved.values())
        traffic[sp] = (fwd.summary(), bwd.summary())
    # The norm/dropout region holds 1/t of plain TP's activations (LayerNorm's input, mean
    # and rstd, dropout's mask: all per token).
    assert sizes[True] * n == sizes[False], sizes
    (plain_f, plain_b), (sp_f, sp_b) = traffic[False], traffic[True]

    def moved(s, *ops):
        return sum(s[op]["bytes"] for op in ops)

    # Forward: all-gather + reduce-scatter move what plain TP's all-reduce moves.
    assert plain_f["all_reduce"]["calls"] == 1 and moved(sp_f, "all_reduce") == 0
    assert moved(sp_f, "all_gather", "reduce_scatter") == moved(plain_f, "all_reduce") > 0
    # Backward: the same, plus the re-gather of the column layer's saved shard (Note
    # [sequence-parallel column layers save the shard]); without it, exactly the same.
    regather = sp_f["all_gather"]["bytes"]
    assert moved(sp_b, "all_gather", "reduce_scatter") == moved(plain_b, "all_reduce") + regather
    block = _parallel(ref, True, save_gathered=True)
    X, W = _data()
    out = block(seq_shard(X).clone().requires_grad_())
    with comm.CommCounter() as bwd:
        (out * seq_shard(W)).sum().backward()
    assert moved(bwd.summary(), "all_gather", "reduce_scatter") == moved(plain_b, "all_reduce")
    return True


@world_sizes(2, 4)
def test_activation_bytes_and_communication_bytes(world_size):
    assert all(run_distributed(_memory_and_bytes_body, world_size))


def _shared_gather_body(sp: bool = True):
    torch.manual_seed(22)
    refs = [nn.Linear(D, H) for _ in range(3)]  # q, k, v
    X, W = _data()
    W = torch.randn(B, T, H, generator=torch.Generator().manual_seed(23))
    results = {}
    for shared in (False, True):
        gather = SharedGather(None, seq_dim=1, gather=sp) if shared else None
        layers = [ColumnParallelLinear.from_module(r, None, sequence_parallel=sp) for r in refs]
        for layer in layers:
            if gather is not None:
                gather.join(layer)  # as whoever builds the siblings does
        x = (seq_shard(X) if sp else X).clone().requires_grad_()
        h = x * 1.0  # the norm's output, say
        with comm.CommCounter() as fwd:
            outs = [layer(h) for layer in layers]
        fshard = [layer.tp_shards["weight"] for layer in layers]
        loss = sum((o * W[..., s.pieces[0][1]:s.pieces[0][1] + s.held]).sum()
                   for o, s in zip(outs, fshard))
        with comm.CommCounter() as bwd:
            loss.backward()
        results[shared] = (outs, x.grad, [layer.weight.grad for layer in layers])
        f, b = fwd.summary(), bwd.summary()
        if not sp:  # plain TP: no forward collective; the input gradients' all-reduce(s)
            assert sum(v["calls"] for v in f.values()) == 0, f
            assert b["all_reduce"]["calls"] == (1 if shared else 3), b
        if shared and sp:
            assert (f["all_gather"]["calls"], f["reduce_scatter"]["calls"]) == (1, 0), f
            assert (b["all_gather"]["calls"], b["reduce_scatter"]["calls"]) == (0, 1), b
        if shared:
            assert (gather.gathers, gather.reuses) == (1, 2)
            h.mul_(1.0)  # an in-place change: the next sibling must gather again
            layers[0](h)
            assert gather.gathers == 2
    (o0, gx0, gw0), (o1, gx1, gw1) = results[False], results[True]
    for a, b in zip(o0 + [gx0] + gw0, o1 + [gx1] + gw1):
        assert_close(a, b, rtol=RTOL, atol=ATOL)
    return True


@pytest.mark.parametrize("sp", [True, False], ids=["sequence-parallel", "plain"])
def test_shared_gather_one_collective_each_way(sp):
    """SP: one all-gather forward, one reduce-scatter backward for q/k/v; plain TP: one
    all-reduce of the summed input gradients instead of three."""
    assert all(run_distributed(_shared_gather_body, 2, args=(sp,)))


def _overlap_body(sp: bool):
    torch.manual_seed(24)
    ref = Block()
    base = _run(_parallel(ref, sp, chunks=1), sp)
    fast = _run(_parallel(ref, sp, chunks=2), sp)
    with SlowLink(0.01), comm.BlockedTimer() as blocked:
        slow = _run(_parallel(ref, sp, chunks=2), sp)
    for a, b in zip(fast, slow):  # when communication completes changes nothing
        assert torch.equal(a, b)
    for a, b in zip(base, fast):  # chunked GEMMs: fp32 reassociation at most
        assert_close(a, b, rtol=RTOL, atol=ATOL)
    return blocked.seconds


@world_sizes(2, 4)
def test_overlap_results_do_not_depend_on_a_slow_link(world_size):
    for sp in (False, True):
        assert all(s > 0 for s in run_distributed(_overlap_body, world_size, args=(sp,)))
