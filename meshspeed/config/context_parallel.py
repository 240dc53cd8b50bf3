"""The `context_parallel` section and DeepSpeed's top-level `sequence_parallel_size`.

Owned by `meshspeed/sequence`. Both name the degree of the mesh's cp axis: the ranks that
hold pieces of the same sequences. `sequence_parallel_size: N` is DeepSpeed-Ulysses
(`mode: "ulysses"`); the `context_parallel` block chooses the method:

    ulysses        all-to-all: all heads of a sequence slice <-> a head slice of all tokens
    ring           Ring Attention over contiguous slices (causal work grows with the rank)
    ring_balanced  Ring Attention over 2 x size chunks, rank i holding i and 2·size-1-i
    hybrid         all-to-all inside groups of `ulysses_size` ranks, the ring across them

`seq_dim` is the dimension of the model's inputs that is the sequence (batch-first: 1).
"""

from __future__ import annotations

from typing import Literal

from pydantic import model_validator

from meshspeed.config.base import PositiveInt, StrictModel

MODES = ("ulysses", "ring", "ring_balanced", "hybrid")


class ContextParallelConfig(StrictModel):
    size: PositiveInt = 1
    mode: Literal["ulysses", "ring", "ring_balanced", "hybrid"] = "ring_balanced"
    ulysses_size: PositiveInt | None = None  # hybrid only: the all-to-all degree
    seq_dim: PositiveInt = 1

    @model_validator(mode="after")
    def _hybrid_sizes(self):
        if self.mode == "hybrid":
            u = self.ulysses_size
            if u is None or self.size % u or not 1 < u < self.size:
                raise ValueError(
                    f"mode \"hybrid\" with size {self.size} needs ulysses_size, a divisor of the "
                    f"size between 1 and {self.size} exclusive (ring degree = size / ulysses_size), "
                    f"got {u}")
        elif self.ulysses_size is not None:
            raise ValueError(f"ulysses_size is for mode \"hybrid\"; mode is \"{self.mode}\" (drop it, "
                             "or set mode \"hybrid\")")
        return self

    @property
    def ring_size(self) -> int:
        if self.mode == "ulysses":
            return 1
        return self.size // (self.ulysses_size or 1)

    @property
    def all_to_all_size(self) -> int:
        """Ranks in each all-to-all group: the whole axis for Ulysses, none for the ring."""
        return {"ulysses": self.size, "hybrid": self.ulysses_size}.get(self.mode, 1)


def resolve(section: ContextParallelConfig, sequence_parallel_size: int) -> ContextParallelConfig:
    """The effective section: DeepSpeed's `sequence_parallel_size` alone means Ulysses of
    that degree; with a `context_parallel` block of its own size the two must agree."""
    sp = sequence_parallel_size
    if sp <= 1:
        return section
    if section.size == 1:
        return ContextParallelConfig(size=sp, mode="ulysses", seq_dim=section.seq_dim)
    if section.size != sp:
        raise ValueError(f"sequence_parallel_size {sp} and context_parallel.size {section.size} name "
                         "the same degree; give one, or make them equal")
    return section
