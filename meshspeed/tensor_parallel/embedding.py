"""`VocabParallelEmbedding`: each rank holds a contiguous slice of the vocabulary's rows
(Megatron-LM, arXiv:1909.08053, section 3: "parallelize the input embedding ... along the
vocabulary dimension").

Rank r looks up the ids in [vocab_start, vocab_end), writes zeros for the others, and the
ranks' outputs are summed: all-reduced (replicated output) or, with sequence parallelism,
reduce-scattered along seq_dim (each rank keeps its sequence shard). A vocabulary that
does not divide by the group size is padded to the next multiple (zero rows on the last
ranks, spec.TPShard padding); a vocab-parallel lm_head tied to this embedding
(`ColumnParallelLinear.tied_to`) shares this very Parameter.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from meshspeed.comm import collectives
from meshspeed.comm.differentiable import reduce_from_parallel, reduce_scatter_sequence
from meshspeed.topology.shards import TPShard, even_pieces


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, group: Any, *,
                 padding_idx: int | None = None, sequence_parallel: bool = False,
                 seq_dim: int = 1, device=None, dtype=None) -> None:
        super().__init__()
        if padding_idx is not None and padding_idx < 0:
            padding_idx += num_embeddings
        self.num_embeddings, self.embedding_dim, self.group = num_embeddings, embedding_dim, group
        self.padding_idx, self.sequence_parallel, self.seq_dim = padding_idx, sequence_parallel, seq_dim
        rank, size = collectives.get_rank(group), collectives.get_world_size(group)
        pieces, local = even_pieces(num_embeddings, rank, size)
        shard = TPShard(0, (num_embeddings, embedding_dim), pieces, local, rank, size)
        self.tp_shards = {"weight": shard}
        self.vocab_start = pieces[0][1]  # logical ids [vocab_start, vocab_end), unpadded
        self.vocab_end = self.vocab_start + shard.held
        self.weight = nn.Parameter(torch.empty(shard.local_shape, device=device, dtype=dtype))
        if self.weight.device.type != "meta":
            self.reset_parameters()

    def reset_parameters(self) -> None:
        # nn.Embedding's N(0, 1), drawn per rank; padding rows and padding_idx zero.
        with torch.no_grad():
            self.weight.normal_()
            self.weight[self.tp_shards["weight"].held:].zero_()
            if self._local_padding_idx() is not None:
                self.weight[self._local_padding_idx()].zero_()

    def _local_padding_idx(self) -> int | None:
        p = self.padding_idx
        return p - self.vocab_start if p is not None and self.vocab_start <= p < self.vocab_end else None

    @classmethod
    def from_module(cls, embedding: nn.Embedding, group: Any, **kw: Any) -> VocabParallelEmbedding:
        """This rank's rows of `embedding` (values copied)."""
        kw.setdefault("padding_idx", embedding.padding_idx)
        layer = cls(embedding.num_embeddings, embedding.embedding_dim, group, device="meta", **kw)
        value = layer.tp_shards["weight"].local_from_logical(embedding.weight.detach())
        layer.weight = nn.Parameter(value, requires_grad=embedding.weight.requires_grad)
        return layer

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight, padding_idx=self._local_padding_idx())
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)  # and no gradient to row 0 from them
        if self.sequence_parallel:
            return reduce_scatter_sequence(out, self.group, self.seq_dim)
        return reduce_from_parallel(out, self.group)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, vocab [{self.vocab_start}, "
                f"{self.vocab_end}), sequence_parallel={self.sequence_parallel}")
