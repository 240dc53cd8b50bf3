"""Column- and row-parallel linear layers (Megatron-LM, arXiv:1909.08053, section 3).

A column layer keeps this rank's output features (rows of nn.Linear's weight), a row
layer its input features. Parameter names and logical shapes stay those of the module
they replace (`weight`, `bias`; nn.Linear's (out, in) or, with weight_layout="in_out",
GPT-2 Conv1D's (in, out)), and `tp_shards` says where each local piece sits
(spec.TPShard), so checkpoints save whole logical parameters.

Sequence parallelism (arXiv:2205.05198): a column layer's input is then a shard of the
sequence (dim seq_dim) that it all-gathers, and a row layer reduce-scatters its output
back to sequence shards instead of all-reducing it.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from meshspeed.comm import collectives
from meshspeed.comm.differentiable import (
    gather_from_parallel,
    reduce_from_parallel,
    reduce_scatter_sequence,
    scatter_to_parallel,
)
from meshspeed.tensor_parallel.overlap import ColumnLinearFn, RowLinearChunkedFn, matmul
from meshspeed.topology.shards import TPShard, even_pieces

_LAYOUTS = ("out_in", "in_out")


def _check_layout(layout: str) -> None:
    if layout not in _LAYOUTS:
        raise ValueError(f"weight_layout must be one of {_LAYOUTS}, got {layout!r}")


def _layout_of(module: nn.Module, given: str | None) -> str:
    if given is not None:
        return given
    return "in_out" if type(module).__name__ == "Conv1D" else "out_in"


def _features(module: nn.Module, layout: str) -> tuple[int, int]:
    """(in_features, out_features) of an nn.Linear or Conv1D."""
    rows, cols = module.weight.shape
    return (cols, rows) if layout == "out_in" else (rows, cols)


def zero_padding_(param: torch.Tensor, shard: TPShard) -> None:
    """Zero the local positions along shard.dim that hold no logical rows."""
    keep = torch.zeros(shard.local_size, dtype=torch.bool)
    for local, _, length in shard.pieces:
        keep[local:local + length] = True
    if not bool(keep.all()):
        with torch.no_grad():
            param.index_fill_(shard.dim, (~keep).nonzero().flatten().to(param.device), 0.0)


def _init_uniform_(param: torch.Tensor, fan_in: int) -> None:
    # nn.Linear's default (kaiming_uniform with a=sqrt(5) is U(-1/sqrt(fan_in), +)),
    # drawn per rank: a layer built directly is not the split of one nn.Linear's init;
    # from_module copies an existing one.
    bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    with torch.no_grad():
        param.uniform_(-bound, bound)


class _ParallelLinear(nn.Module):
    """What the column and row layers share: their options, building from a whole
    module, and repr."""

    def __init__(self, in_features: int, out_features: int, group: Any, sequence_parallel: bool,
                 overlap_chunks: int, seq_dim: int, weight_layout: str) -> None:
        super().__init__()
        _check_layout(weight_layout)
        if overlap_chunks < 1:
            raise ValueError(f"overlap_chunks must be >= 1, got {overlap_chunks}")
        self.in_features, self.out_features, self.group = in_features, out_features, group
        self.sequence_parallel, self.overlap_chunks = sequence_parallel, overlap_chunks
        self.seq_dim, self.weight_layout = seq_dim, weight_layout

    @classmethod
    def from_module(cls, linear: nn.Module, group: Any, **kw: Any):
        """This rank's slice of an nn.Linear (or HF Conv1D: weight_layout="in_out",
        detected by class name) with its values copied."""
        layout = _layout_of(linear, kw.pop("weight_layout", None))
        in_f, out_f = _features(linear, layout)
        layer = cls(in_f, out_f, group, bias=linear.bias is not None, weight_layout=layout,
                    device="meta", **kw)
        _copy_slices(layer, linear)
        return layer

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"local={self.tp_shards['weight'].local_size}, layout={self.weight_layout}, "
                f"sequence_parallel={self.sequence_parallel}, overlap_chunks={self.overlap_chunks}")


class ColumnParallelLinear(_ParallelLinear):
    """y[..., this rank's output features] = x W^T (+ b); see the module docstring.

    parts / multiple: fused sub-parameters split each on its own (spec.even_pieces);
    without parts an out_features that does not divide is padded (zero rows at the end
    of the last ranks). gather_output: return the whole (logical) output on every rank.
    shared_gather: a SharedGather shared with sibling layers (Note [one gather for
    sibling column layers]). save_gathered_input: Note [sequence-parallel column layers
    save the shard]. overlap_chunks: Note [overlapping tensor-parallel communication]."""

    def __init__(self, in_features: int, out_features: int, group: Any, *, bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False,
                 overlap_chunks: int = 1, seq_dim: int = 1, parts: tuple[int, ...] | None = None,
                 multiple: int = 1, weight_layout: str = "out_in", device=None, dtype=None,
                 shared_gather: Any = None, save_gathered_input: bool = False) -> None:
        super().__init__(in_features, out_features, group, sequence_parallel, overlap_chunks,
                         seq_dim, weight_layout)
        self.gather_output = gather_output
        self.shared_gather, self.save_gathered_input = shared_gather, save_gathered_input
        if shared_gather is not None and hasattr(shared_gather, "join"):
            shared_gather.join(self)
        rank, size = collectives.get_rank(group), collectives.get_world_size(group)
        pieces, local = even_pieces(out_features, rank, size, parts=parts, multiple=multiple)
        dim = 0 if weight_layout == "out_in" else 1
        logical = (out_features, in_features) if dim == 0 else (in_features, out_features)
        wshard = TPShard(dim, logical, pieces, local, rank, size)
        self.weight = nn.Parameter(torch.empty(wshard.local_shape, device=device, dtype=dtype))
        self.tp_shards = {"weight": wshard}
        if bias:
            self.bias = nn.Parameter(torch.empty(local, device=device, dtype=dtype))
            self.tp_shards["bias"] = TPShard(0, (out_features,), pieces, local, rank, size)
        else:
            self.register_parameter("bias", None)
        self._perm = _gather_order(out_features, size, parts, multiple)
        if self.weight.device.type != "meta":
            self.reset_parameters()

    def reset_parameters(self) -> None:
        for name, shard in self.tp_shards.items():
            param = getattr(self, name)
            _init_uniform_(param, self.in_features)
            zero_padding_(param, shard)

    @classmethod
    def tied_to(cls, embedding: nn.Module, **kw: Any) -> ColumnParallelLinear:
        """A vocab-parallel output projection (lm_head) that shares `embedding`'s weight
        Parameter (a VocabParallelEmbedding over the same group: same padded rows, same
        TPShard), so the tie stays one Parameter. No bias. Keywords as the constructor's
        (sequence_parallel, gather_output, overlap_chunks, ...)."""
        layer = cls(embedding.embedding_dim, embedding.num_embeddings, embedding.group,
                    bias=False, device="meta", **kw)
        if layer.tp_shards["weight"] != embedding.tp_shards["weight"]:
            raise ValueError("the embedding is split differently from a column layer over its "
                             "vocabulary")
        layer.weight = embedding.weight
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mode, chunks = ("gather" if self.sequence_parallel else "copy"), self.overlap_chunks
        shared = self.shared_gather
        if shared is not None and hasattr(shared, "output"):  # Note [one gather for sibling column layers]
            return shared.output(self, x)
        if shared is not None:  # a boundary gathered the input already (boundaries.py)
            x, mode = shared(x), "local"
        out = ColumnLinearFn.apply(x, self.weight, self.bias, self.group, mode, self.seq_dim,
                                   chunks, self.save_gathered_input, self.weight_layout)
        if self.gather_output:
            out = gather_from_parallel(out, self.group, -1)
            if self._perm is not None:  # fused parts: [q0|k0|v0|q1|..] -> [q|k|v]
                out = out.index_select(-1, self._perm.to(out.device))
            elif out.shape[-1] != self.out_features:  # padding at the end
                out = out.narrow(-1, 0, self.out_features)
        return out


def _gather_order(n: int, size: int, parts, multiple: int) -> torch.Tensor | None:
    """Positions in the rank-concatenated output of logical features 0..n-1, or None if
    they are the first n positions in order (one piece per rank, padding at the end)."""
    index, local = torch.empty(n, dtype=torch.long), None
    for r in range(size):
        pieces, local = even_pieces(n, r, size, parts=parts, multiple=multiple)
        for local_start, logical, length in pieces:
            index[logical:logical + length] = torch.arange(length) + r * local + local_start
    return None if torch.equal(index, torch.arange(n)) else index


def _copy_slices(layer: nn.Module, source: nn.Module) -> None:
    """Materialize `layer`'s (meta) split parameters from `source`'s whole ones; copy
    replicated ones whole."""
    for name, param in list(layer.named_parameters(recurse=False)):
        whole = getattr(source, name).detach()
        shard = layer.tp_shards.get(name)
        value = shard.local_from_logical(whole) if shard is not None else whole.clone()
        new = nn.Parameter(value, requires_grad=getattr(source, name).requires_grad)
        setattr(layer, name, new)


class RowParallelLinear(_ParallelLinear):
    """y = (sum over ranks of x[..., this rank's input features] W_r^T) + b.

    input_is_parallel=False: x is whole and each rank keeps its input features first. The
    bias is replicated (no TPShard) and added once after the reduction; with
    sequence_parallel its gradient is a partial sum over the group (`tp_partial_grads`)."""

    def __init__(self, in_features: int, out_features: int, group: Any, *, bias: bool = True,
                 input_is_parallel: bool = True, sequence_parallel: bool = False,
                 overlap_chunks: int = 1, seq_dim: int = 1, weight_layout: str = "out_in",
                 device=None, dtype=None) -> None:
        super().__init__(in_features, out_features, group, sequence_parallel, overlap_chunks,
                         seq_dim, weight_layout)
        self.input_is_parallel = input_is_parallel
        rank, size = collectives.get_rank(group), collectives.get_world_size(group)
        if not input_is_parallel and in_features % size:
            raise ValueError(f"in_features {in_features} does not split over {size} ranks")
        pieces, local = even_pieces(in_features, rank, size)
        dim = 1 if weight_layout == "out_in" else 0
        logical = (out_features, in_features) if dim == 1 else (in_features, out_features)
        wshard = TPShard(dim, logical, pieces, local, rank, size)
        self.weight = nn.Parameter(torch.empty(wshard.local_shape, device=device, dtype=dtype))
        self.tp_shards = {"weight": wshard}
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype))
            if sequence_parallel:
                self.tp_partial_grads = ("bias",)
        else:
            self.register_parameter("bias", None)
        if self.weight.device.type != "meta":
            self.reset_parameters()

    def reset_parameters(self) -> None:
        _init_uniform_(self.weight, self.in_features)
        zero_padding_(self.weight, self.tp_shards["weight"])
        if self.bias is not None:
            _init_uniform_(self.bias, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_parallel(x, self.group, -1)
        if self.overlap_chunks > 1:  # Note [overlapping tensor-parallel communication]
            mode = "scatter" if self.sequence_parallel else "reduce"
            out = RowLinearChunkedFn.apply(x, self.weight, self.group, mode, self.seq_dim,
                                           self.overlap_chunks, self.weight_layout)
        else:
            partial = matmul(x, self.weight, self.weight_layout)
            if self.sequence_parallel:
                out = reduce_scatter_sequence(partial, self.group, self.seq_dim)
            else:
                out = reduce_from_parallel(partial, self.group)
        return out if self.bias is None else out + self.bias
