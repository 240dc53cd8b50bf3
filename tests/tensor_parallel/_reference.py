"""Helpers for the tensor-parallel layer tests: the one-process reference and the
comparisons of a rank's shards with it."""

from __future__ import annotations

import torch
from torch import nn
from torch.testing import assert_close

from meshspeed import comm
from meshspeed.topology.shards import TPShard

RTOL, ATOL = 1e-5, 1e-6  # fp32; sums over ranks and chunked GEMMs reassociate


class Conv1D(nn.Module):
    """GPT-2's Conv1D as Hugging Face writes it: weight (in, out), y = x W + b. Defined
    here so the tests need not import transformers; the layers detect it by class name."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.5)
        self.bias = nn.Parameter(torch.randn(nf) * 0.5)

    def forward(self, x):
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(
            *x.shape[:-1], self.nf)


def reference_linear(in_f: int, out_f: int, layout: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    if layout == "out_in":
        m = nn.Linear(in_f, out_f)
        with torch.no_grad():
            m.bias.normal_()  # nn.Linear's bias init is small; make it matter
        return m
    return Conv1D(out_f, in_f)


def feature_shard(weight_shard: TPShard, shape: tuple[int, ...], dim: int) -> TPShard:
    """The same pieces as `weight_shard`, along `dim` of a tensor of `shape`."""
    return TPShard(dim % len(shape), tuple(shape), weight_shard.pieces, weight_shard.local_size,
                   weight_shard.tp_rank, weight_shard.tp_size)


def assert_shard_matches(local: torch.Tensor, shard: TPShard, whole: torch.Tensor, group=None):
    """`local` is this rank's part of `whole` (padding zero), and the ranks' parts
    written back with logical_into cover `whole`."""
    assert_close(local, shard.local_from_logical(whole), rtol=RTOL, atol=ATOL)
    assembled = torch.zeros(shard.logical_shape)
    shard.logical_into(local.detach(), assembled)
    comm.all_reduce(assembled, group=group)
    assert_close(assembled, whole, rtol=RTOL, atol=ATOL)


def seq_shard(t: torch.Tensor, dim: int = 1) -> torch.Tensor:
    n, r = comm.get_world_size(), comm.get_rank()
    return t.chunk(n, dim)[r]
