"""Column/row-parallel linear layers against nn.Linear and GPT-2's Conv1D on one process:
forward output and the gradients of input, weight and bias, with and without sequence
parallelism and overlap chunks, fused parts and padding. World sizes 2 and 4, fp32,
rtol 1e-5 (sums over ranks and chunked GEMMs reassociate)."""

from __future__ import annotations

import itertools

import torch
from torch.testing import assert_close

from meshspeed import comm
from meshspeed.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from meshspeed.testing import run_distributed, world_sizes
from tests.tensor_parallel._reference import (
    ATOL,
    RTOL,
    assert_shard_matches,
    feature_shard,
    reference_linear,
    seq_shard,
)

B, T, IN = 2, 8, 6


def _data(out_f: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, IN, generator=g), torch.randn(B, T, out_f, generator=g)


def _check_column(layout, out_f, sp, chunks, parts=None, multiple=1, gather_output=False):
    ref = reference_linear(IN, out_f, layout, seed=3)
    layer = ColumnParallelLinear.from_module(ref, None, sequence_parallel=sp, overlap_chunks=chunks,
                                             parts=parts, multiple=multiple,
                                             gather_output=gather_output)
    assert layer.weight_layout == layout
    X, W = _data(out_f, seed=4)
    xr = X.clone().requires_grad_()
    ref_out = ref(xr)
    (ref_out * W).sum().backward()

    x = (seq_shard(X) if sp else X).clone().requires_grad_()
    out = layer(x)
    wshard = layer.tp_shards["weight"]
    if gather_output:  # replicated output, every rank holds the one loss
        assert_close(out, ref_out, rtol=RTOL, atol=ATOL)
        (out * W).sum().backward()
    else:  # this rank's output features (padding zero); the loss is the sum of the ranks'
        fshard = feature_shard(wshard, tuple(ref_out.shape), -1)
        assert_close(out, fshard.local_from_logical(ref_out.detach()), rtol=RTOL, atol=ATOL)
        (out * fshard.local_from_logical(W)).sum().backward()
    assert_close(x.grad, seq_shard(xr.grad) if sp else xr.grad, rtol=RTOL, atol=ATOL)
    assert_shard_matches(layer.weight.grad, wshard, ref.weight.grad)
    assert_shard_matches(layer.bias.grad, layer.tp_shards["bias"], ref.bias.grad)


def _check_row(layout, out_f, sp, chunks, input_is_parallel=True, in_f=IN):
    ref = reference_linear(in_f, out_f, layout, seed=5)
    layer = RowParallelLinear.from_module(ref, None, sequence_parallel=sp, overlap_chunks=chunks,
                                          input_is_parallel=input_is_parallel)
    g = torch.Generator().manual_seed(6)
    X, W = torch.randn(B, T, in_f, generator=g), torch.randn(B, T, out_f, generator=g)
    xr = X.clone().requires_grad_()
    ref_out = ref(xr)
    (ref_out * W).sum().backward()

    wshard = layer.tp_shards["weight"]
    xshard = feature_shard(wshard, tuple(X.shape), -1)
    x = (xshard.local_from_logical(X) if input_is_parallel else X).clone().requires_grad_()
    out = layer(x)
    if sp:  # a sequence shard of the output; the loss is the sum of the ranks'
        assert_close(out, seq_shard(ref_out.detach()), rtol=RTOL, atol=ATOL)
        (out * seq_shard(W)).sum().backward()
    else:
        assert_close(out, ref_out, rtol=RTOL, atol=ATOL)
        (out * W).sum().backward()
    want_x = xshard.local_from_logical(xr.grad) if input_is_parallel else xr.grad
    assert_close(x.grad, want_x, rtol=RTOL, atol=ATOL)
    assert_shard_matches(layer.weight.grad, wshard, ref.weight.grad)
    assert "bias" not in layer.tp_shards  # replicated
    bias_grad = layer.bias.grad.clone()
    if sp:  # each rank's covers its sequence shard: a partial sum over the group
        assert layer.tp_partial_grads == ("bias",)
        comm.all_reduce(bias_grad)
    assert_close(bias_grad, ref.bias.grad, rtol=RTOL, atol=ATOL)


def _linear_body(layout: str):
    n = comm.get_world_size()
    checked = 0
    for sp, chunks in itertools.product((False, True), (1, 2)):
        _check_column(layout, 8, sp, chunks)
        _check_column(layout, 7, sp, chunks)  # padded: 7 output features over n ranks
        _check_column(layout, 7, sp, chunks, gather_output=True)
        e = 2 * n
        _check_column(layout, 3 * e, sp, chunks, parts=(e, e, e), multiple=2)  # fused q|k|v
        _check_column(layout, 3 * e, sp, chunks, parts=(e, e, e), multiple=2, gather_output=True)
        _check_row(layout, 5, sp, chunks)
        _check_row(layout, 5, sp, chunks, in_f=7)  # padded input features
        _check_row(layout, 5, sp, chunks, input_is_parallel=False, in_f=4 * n)
        checked += 8
    return checked


@world_sizes(2, 4)
def test_linear_layers_match_one_process(world_size):
    for layout in ("out_in", "in_out"):
        assert run_distributed(_linear_body, world_size, args=(layout,)) == [32] * world_size


def _fused_layout_body():
    """A rank of a fused q|k|v column keeps [q_r | k_r | v_r] in multiples of the head dim."""
    n, r = comm.get_world_size(), comm.get_rank()
    e, hd = 4 * n, 2
    layer = ColumnParallelLinear(IN, 3 * e, None, parts=(e, e, e), multiple=hd, device="meta")
    shard = layer.tp_shards["weight"]
    each = e // n
    assert shard.pieces == tuple((p * each, p * e + r * each, each) for p in range(3))
    padded = ColumnParallelLinear(IN, 7, None, weight_layout="in_out")
    wshard = padded.tp_shards["weight"]
    assert wshard.dim == 1 and wshard.logical_shape == (IN, 7) and padded.weight.shape == (IN, 4)
    assert bool((padded.weight[:, wshard.held:] == 0).all())
    return True


def test_fused_parts_and_padding_layout():
    assert all(run_distributed(_fused_layout_body, 2))
