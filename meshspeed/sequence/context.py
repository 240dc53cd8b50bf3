"""`ContextParallel`: what the engine and the model's attention share under context
parallelism -- the method, the groups from the mesh, and the layout of the sequence the
current batch was cut into.

The engine cuts each batch (meshspeed/sequence/data.py) and records its layout here; the
attention layers it was attached to (meshspeed/sequence/models.py) call `attend`, which
runs the configured method over the mesh's cp axis, and read `positions`, the global
positions of this rank's tokens, for their rotary embeddings. The layout stays recorded
after the forward, so activation checkpointing that recomputes a layer in backward sees
the same positions.
"""

from __future__ import annotations

import torch

from meshspeed.config.context_parallel import ContextParallelConfig
from meshspeed.sequence.groups import hybrid_groups
from meshspeed.sequence.hybrid import hybrid_attention
from meshspeed.sequence.layer import ulysses_attention
from meshspeed.sequence.ring import ring_attention
from meshspeed.sequence.sharding import SequenceLayout
from meshspeed.topology import Topology


class ContextParallel:
    def __init__(self, section: ContextParallelConfig, topology: Topology) -> None:
        self.mode = section.mode
        self.degree = section.size
        self.seq_dim = section.seq_dim
        self.group = topology.group("cp")
        self.rank = topology.coord("cp")
        self.balanced = self.mode in ("ring_balanced", "hybrid")
        self.ulysses_size = section.all_to_all_size
        if self.mode == "hybrid":
            self.ulysses_group, self.ring_group = hybrid_groups(topology, self.ulysses_size)
        self.layout: SequenceLayout | None = None
        self.positions: torch.Tensor | None = None  # (local_len,) int64 global positions
        self.max_positions: int | None = None  # the model's longest sequence, when it has one

    def __repr__(self) -> str:
        return f"ContextParallel({self.mode}, degree {self.degree}, rank {self.rank})"

    def set_sequence(self, seq_len: int, device: torch.device) -> SequenceLayout:
        """Record the layout of a batch of `seq_len`-token sequences (raises, naming the
        length and the multiple it needs, when it cannot be cut evenly)."""
        if self.max_positions is not None and seq_len > self.max_positions:
            raise ValueError(f"sequence length {seq_len} exceeds the model's max_seq_len={self.max_positions}")
        if self.layout is None or self.layout.seq_len != seq_len or self.positions.device != device:
            self.layout = SequenceLayout(seq_len, self.degree, self.balanced)
            self.positions = self.layout.positions(self.rank, device=device)
        return self.layout

    def check_heads(self, heads: int, kv_heads: int, where: str) -> None:
        """One sentence at setup when the all-to-all cannot split the heads."""
        u = self.ulysses_size
        if u == 1:
            return
        method = "Ulysses" if self.mode == "ulysses" else f"the all-to-all axis (ulysses_size {u}) of hybrid"
        if heads % u:
            raise ValueError(f"{where}: {heads} attention heads per rank are not divisible by {method} "
                             f"degree {u}; choose a degree that divides {heads}"
                             + (" (or use mode \"ring\"/\"ring_balanced\", which has no head limit, or "
                                "\"hybrid\" with a smaller ulysses_size)" if self.mode == "ulysses" else ""))
        if kv_heads % u and u % kv_heads:
            raise ValueError(f"{where}: {kv_heads} key/value heads per rank neither divide nor are a "
                             f"multiple of the {method} degree {u}; use a degree that {kv_heads} "
                             "divides or that divides it")

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
               scale: float | None = None) -> torch.Tensor:
        """Attention of this rank's queries (b, h, local_len, d) over the whole sequence;
        k/v may have fewer heads (grouped-query attention)."""
        layout = self.layout
        if layout is None:
            raise RuntimeError("context-parallel attention ran before the engine cut a batch; call "
                               "the engine (engine(batch)), not engine.module, under context parallelism")
        if q.size(2) != layout.local_len:
            raise ValueError(f"attention got {q.size(2)} tokens per rank, but the batch was cut into "
                             f"{layout.local_len} ({layout.seq_len} over {self.degree} ranks)")
        if self.mode == "ulysses":
            return ulysses_attention(q, k, v, self.group, causal=causal, scale=scale)
        if self.mode in ("ring", "ring_balanced"):
            chunks = [layout.chunks(r) for r in range(self.degree)]
            return ring_attention(q, k, v, self.group, causal=causal, scale=scale, chunk_ids=chunks)
        u = self.ulysses_size
        chunks = [sum((layout.chunks(j * u + i) for i in range(u)), ()) for j in range(self.degree // u)]
        return hybrid_attention(q, k, v, self.ulysses_group, self.ring_group, causal=causal, scale=scale,
                                chunk_ids=chunks)
