"""DeepSpeed 0.19's checkpoint file names and how ZeRO lays parameters out in flat partitions.

Note [DeepSpeed's flat partitions]
ZeRO 1/2: each optimizer param group's trainable parameters, in group order, are
concatenated into one flat buffer, padded at the end to a multiple of 2 * dp (the
alignment DeepSpeed keeps for NCCL), and cut into dp equal partitions; rank r's
partition is [r * P, (r + 1) * P). Its file holds the fp32 masters of the partition
without the trailing padding (`group_paddings[r]` elements, only the last ranks have
any), and the optimizer moments of the whole partition, padding included.
ZeRO 3: every parameter is cut on its own into dp pieces of ceil(numel / dp) elements
(the last piece zero-padded); rank r's flat buffer of a sub-group is its pieces of the
sub-group's parameters, concatenated. A param group is split into sub-groups once the
pieces reach `sub_group_size` elements.
The tests check these against files DeepSpeed 0.19.8 wrote (golden JSON).
"""

from __future__ import annotations

from dataclasses import dataclass

LATEST = "latest"
MP_RANK = 0  # no tensor parallelism in what this writer produces
ALIGNMENT_FACTOR = 2  # DeepSpeed's nccl_start_alignment_factor


def model_states_name(stage: int, dp_rank: int) -> str:
    """Rank dp_rank's model-states file (under ZeRO 3 every rank has one; else one only)."""
    if stage == 3:
        return f"zero_pp_rank_{dp_rank}_mp_rank_{MP_RANK:02d}_model_states.pt"
    return f"mp_rank_{MP_RANK:02d}_model_states.pt"


def optim_states_name(dp_rank: int, bf16: bool) -> str:
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{dp_rank}_mp_rank_{MP_RANK:02d}_optim_states.pt"


@dataclass(frozen=True)
class Piece:
    """Elements [start, end) of parameter `name` at `offset` in a rank's flat buffer."""

    name: str
    start: int
    end: int
    offset: int

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Partition:
    """One rank's flat buffer of one group: `numel` elements (padding included), of which
    the last `padding` hold no parameter."""

    pieces: list[Piece]
    numel: int
    padding: int


def flat_partitions(params: list[tuple[str, int]], dp: int) -> list[Partition]:
    """ZeRO 1/2: every rank's partition of one param group (Note [DeepSpeed's flat partitions])."""
    total = sum(n for _, n in params)
    align = ALIGNMENT_FACTOR * dp
    padded = -(-total // align) * align
    size = padded // dp
    out = []
    for r in range(dp):
        lo, hi = r * size, (r + 1) * size
        pieces, pos = [], 0
        for name, n in params:
            a, b = max(lo, pos), min(hi, pos + n)
            if a < b:
                pieces.append(Piece(name, a - pos, b - pos, a - lo))
            pos += n
        out.append(Partition(pieces, size, hi - max(lo, min(hi, total))))
    return out


def sub_groups(params: list[tuple[str, int]], dp: int, sub_group_size: int) -> list[list[tuple[str, int]]]:
    """ZeRO 3: the sub-groups of one param group (DeepSpeed counts partition sizes)."""
    total = sum(-(-n // dp) for _, n in params)
    if sub_group_size is None or sub_group_size >= total:
        return [list(params)]
    groups, current, size = [], [], 0
    for i, (name, n) in enumerate(params):
        current.append((name, n))
        size += -(-n // dp)
        if size >= sub_group_size or i == len(params) - 1:
            groups.append(current)
            current, size = [], 0
    return groups


def param_partition(params: list[tuple[str, int]], dp: int, rank: int) -> Partition:
    """ZeRO 3: rank `rank`'s flat buffer of one sub-group."""
    pieces, offset, padding = [], 0, 0
    for name, n in params:
        size = -(-n // dp)
        a, b = min(rank * size, n), min((rank + 1) * size, n)
        if a < b:
            pieces.append(Piece(name, a, b, offset))
        padding += size - (b - a)
        offset += size
    return Partition(pieces, offset, padding)
