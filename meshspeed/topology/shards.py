"""Where a tensor-parallel rank's local parameter sits in the logical (whole) parameter.

The contract between the tensor-parallel layers (which split parameters), the checkpoint
(which saves and loads logical, whole-parameter names and element positions), gradient
clipping (which counts a sharded parameter's squares on every tp rank and a replicated
one once) and the memory estimator. A parameter that tensor parallelism did not split has
no `TPShard`: it is replicated over the tp group.

Note [pieces of a tensor-parallel shard]
A local parameter is cut from the logical one along one dimension `dim`. Usually it is
one contiguous block: rank r of t keeps rows [r*n/t, (r+1)*n/t). Two cases need more:
* a fused projection (GPT-2's `c_attn` = [q | k | v], a packed gate/up) is split per
  part, so a rank keeps [q_r | k_r | v_r]: three pieces, each contiguous in both tensors;
* a vocabulary that does not divide by t is padded: the local tensor is longer along
  `dim` than the logical rows it holds (the last rank's tail is padding, kept at zero and
  never saved).
So a shard is a list of pieces `(local_start, logical_start, length)` along `dim`, plus
the local length along `dim`. Every other dimension is whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TPShard:
    dim: int  # the dimension of the parameter that is split (same index locally and logically)
    logical_shape: tuple[int, ...]  # the whole parameter's shape, without padding
    pieces: tuple[tuple[int, int, int], ...]  # (local_start, logical_start, length) along dim
    local_size: int  # the local tensor's length along dim (padding included)
    tp_rank: int  # this rank's coordinate in its tensor-parallel group
    tp_size: int

    def __post_init__(self) -> None:
        if not 0 <= self.dim < len(self.logical_shape):
            raise ValueError(f"TPShard.dim {self.dim} is not a dimension of shape {self.logical_shape}")
        n = self.logical_shape[self.dim]
        for local, logical, length in self.pieces:
            if length < 0 or local < 0 or local + length > self.local_size or logical < 0 \
                    or logical + length > n:
                raise ValueError(f"TPShard piece {(local, logical, length)} does not fit local size "
                                 f"{self.local_size} / logical size {n} along dim {self.dim}")

    @property
    def local_shape(self) -> tuple[int, ...]:
        shape = list(self.logical_shape)
        shape[self.dim] = self.local_size
        return tuple(shape)

    @property
    def held(self) -> int:
        """Logical rows (along dim) this rank holds; less than local_size when padded."""
        return sum(length for _, _, length in self.pieces)

    def local_from_logical(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's local tensor cut from the whole one (padding zero)."""
        if tuple(full.shape) != self.logical_shape:
            raise ValueError(f"expected the whole parameter of shape {self.logical_shape}, got "
                             f"{tuple(full.shape)}")
        out = full.new_zeros(self.local_shape)
        for local, logical, length in self.pieces:
            out.narrow(self.dim, local, length).copy_(full.narrow(self.dim, logical, length))
        return out

    def logical_into(self, local: torch.Tensor, full: torch.Tensor) -> None:
        """Write this rank's pieces of `local` into their places in the whole tensor `full`."""
        for local_start, logical, length in self.pieces:
            full.narrow(self.dim, logical, length).copy_(local.narrow(self.dim, local_start, length))

    def to_json(self) -> dict:
        return {"dim": self.dim, "logical_shape": list(self.logical_shape),
                "pieces": [list(p) for p in self.pieces], "local_size": self.local_size,
                "tp_rank": self.tp_rank, "tp_size": self.tp_size}

    @classmethod
    def from_json(cls, d: dict) -> TPShard:
        return cls(int(d["dim"]), tuple(d["logical_shape"]), tuple(tuple(p) for p in d["pieces"]),
                   int(d["local_size"]), int(d["tp_rank"]), int(d["tp_size"]))


def even_pieces(n: int, rank: int, size: int, *, parts: tuple[int, ...] | None = None,
                multiple: int = 1) -> tuple[tuple[tuple[int, int, int], ...], int]:
    """Pieces and local size for splitting length `n` evenly over `size` ranks.

    parts: sizes of fused sub-parameters laid end to end (sum == n), each split evenly on
    its own (GPT-2's q|k|v). multiple: each part's per-rank length must be a multiple of
    this (a head dimension). Without parts, a length that does not divide is padded to the
    next multiple of `size` (vocabularies); with parts every part must divide."""
    if parts is None:
        local = -(-n // size)
        start = min(n, rank * local)
        length = min(n, start + local) - start
        return ((0, start, length),), local
    if sum(parts) != n:
        raise ValueError(f"fused parts {parts} do not add up to {n}")
    pieces, local_at, logical_at = [], 0, 0
    for part in parts:
        if part % (size * multiple):
            raise ValueError(f"a fused part of size {part} does not split over {size} ranks in "
                             f"multiples of {multiple}")
        each = part // size
        pieces.append((local_at, logical_at + rank * each, each))
        local_at += each
        logical_at += part
    return tuple(pieces), local_at


def shards_by_param(module: torch.nn.Module) -> dict[int, TPShard]:
    """{id(parameter): TPShard} for every parameter tensor parallelism split in `module`
    (layers list theirs in a `tp_shards` dict: attribute name -> TPShard)."""
    out: dict[int, TPShard] = {}
    for sub in module.modules():
        for attr, shard in getattr(sub, "tp_shards", {}).items():
            param = getattr(sub, attr)
            out[id(param)] = shard
    return out


def shards_by_name(module: torch.nn.Module) -> dict[str, TPShard]:
    """{parameter name as in named_parameters(): TPShard} for the split parameters."""
    by_id = shards_by_param(module)
    return {name: by_id[id(p)] for name, p in module.named_parameters() if id(p) in by_id}


def partial_grad_params(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters whose gradients are partial sums over the tp group (sequence-parallel
    norms, a sequence-parallel row layer's bias), each once, in module order (modules list
    theirs in `tp_partial_grads`: attribute names). The engine all-reduces their gradients
    over tp once per step."""
    out: dict[int, torch.nn.Parameter] = {}
    for sub in module.modules():
        for attr in getattr(sub, "tp_partial_grads", ()):
            param = getattr(sub, attr)
            if param is not None:
                out.setdefault(id(param), param)
    return list(out.values())
