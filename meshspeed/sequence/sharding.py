"""Which tokens of a sequence each context-parallel rank holds.

A sequence of length S is cut into equal chunks. Without balancing there are `degree`
chunks and rank i holds chunk i. With a causal mask that gives rank i work on i+1 key
blocks, the last rank `degree` times the first's; load-balanced context parallelism
(Megatron-LM's CP) cuts 2 x degree chunks and gives rank i chunks i and 2·degree-1-i, so
every rank does the same work: 2·degree+1 chunk pairs, two of them on the diagonal.

A rank's local sequence is its chunks concatenated in the order `chunks(rank)` lists them. Everything
that needs global positions (rotary embeddings, the causal mask between chunks) reads them
from `positions(rank)`; `chunks(rank)` is the same information at chunk granularity, which
is what the ring uses to skip blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SequenceLayout:
    seq_len: int  # S, the whole sequence
    degree: int  # ranks the sequence is split over
    balanced: bool = False  # 2·degree chunks, rank i holds i and 2·degree-1-i

    def __post_init__(self) -> None:
        if self.degree < 1:
            raise ValueError(f"context-parallel degree must be at least 1, got {self.degree}")
        if self.seq_len % self.n_chunks:
            kind = "2 x degree" if self.balanced else "the degree"
            raise ValueError(
                f"sequence length {self.seq_len} is not divisible by {kind} = {self.n_chunks} "
                f"(context parallel over {self.degree} ranks{', load-balanced' if self.balanced else ''}); "
                f"pad or cut the sequences to a multiple of {self.n_chunks}")

    @property
    def n_chunks(self) -> int:
        return 2 * self.degree if self.balanced else self.degree

    @property
    def chunk_len(self) -> int:
        return self.seq_len // self.n_chunks

    @property
    def local_len(self) -> int:
        return self.seq_len // self.degree

    def chunks(self, rank: int) -> tuple[int, ...]:
        """Global chunk indices rank `rank` holds, in the order of its local sequence."""
        if not 0 <= rank < self.degree:
            raise ValueError(f"rank {rank} out of range [0, {self.degree})")
        return (rank, 2 * self.degree - 1 - rank) if self.balanced else (rank,)

    def positions(self, rank: int, device: torch.device | str | None = None) -> torch.Tensor:
        """Global positions (int64, local_len) of the tokens rank `rank` holds."""
        c = self.chunk_len
        return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in self.chunks(rank)])

    def shard(self, x: torch.Tensor, rank: int, dim: int = 1) -> torch.Tensor:
        """Rank `rank`'s tokens of `x`, whose `dim` is the whole sequence (a contiguous copy)."""
        if x.size(dim) != self.seq_len:
            raise ValueError(f"expected a sequence of {self.seq_len} along dim {dim}, got shape {tuple(x.shape)}")
        c = self.chunk_len
        return torch.cat([x.narrow(dim, i * c, c) for i in self.chunks(rank)], dim=dim)

    def unshard(self, pieces: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
        """The whole sequence from every rank's `shard` (pieces in rank order)."""
        if len(pieces) != self.degree:
            raise ValueError(f"expected {self.degree} pieces, got {len(pieces)}")
        c = self.chunk_len
        by_chunk: dict[int, torch.Tensor] = {}
        for rank, piece in enumerate(pieces):
            for j, chunk in enumerate(self.chunks(rank)):
                by_chunk[chunk] = piece.narrow(dim, j * c, c)
        return torch.cat([by_chunk[i] for i in range(self.n_chunks)], dim=dim)
