"""Parallel degrees and the rank arithmetic behind them. Pure integers: no processes.

A world of ``world_size`` ranks is a 4-D grid with axes ``(pp, dp, cp, tp)``, laid out
row-major so that tensor parallel varies fastest, then context parallel, then data
parallel, then pipeline parallel (Megatron-LM's order; Shoeybi et al. 2019, Narayanan et
al. 2021)::

    rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i

Tensor-parallel peers are therefore neighbours (same node, fastest link), and pipeline
stages are the furthest apart (point-to-point traffic only).

Besides the four mesh axes there are three derived axes:

``dp_cp``
    data x context parallel: the ranks that hold the same dense-parameter shard and
    whose gradients are averaged together when ``cp > 1`` (context-parallel ranks see
    different tokens of the same samples, so they reduce gradients like data parallel).

``ep`` / ``edp``
    expert parallel and expert-data parallel (DeepSpeed-MoE, Rajbhandari et al. 2022).
    Experts are sharded over a subset of each data-parallel group. Take one dp group,
    with its ranks ordered by dp index ``r_0 < r_1 < ... < r_{dp-1}``:

    * its **ep groups** are consecutive blocks of ``ep`` ranks:
      ``[r_0 .. r_{ep-1}], [r_ep .. r_{2ep-1}], ...`` -- together they hold one full
      copy of the experts;
    * its **edp groups** take every ``ep``-th rank: ``[r_j, r_{j+ep}, r_{j+2ep}, ...]``
      for ``j < ep`` -- the ranks holding the *same* expert shard, which average its
      gradients.

    So ``ep * edp == dp``; a rank's ep coordinate is ``dp_i % ep`` and its edp
    coordinate ``dp_i // ep``. Experts are not sharded across context-parallel ranks.

For every axis, every rank is in exactly one group, each group is sorted, and a rank's
coordinate on an axis is its position in that group.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, InitVar, dataclass

MESH_DIM_NAMES = ("pp", "dp", "cp", "tp")  # slowest- to fastest-varying
DERIVED_AXES = ("dp_cp", "ep", "edp")
AXES = MESH_DIM_NAMES + DERIVED_AXES


def launch_hint(multiple: int, world: int) -> str:
    """How to fix a degree the world size does not divide, for error messages:
    "launch a multiple of 4 processes (now 2)"."""
    return f"launch a multiple of {multiple} process{'es' * (multiple != 1)} (now {world})"


@dataclass(frozen=True)
class ParallelDims:
    """Parallel degrees of one training job; ``dp`` is whatever the others leave.

    ``sp`` is accepted as an init-only alias for ``cp`` (DeepSpeed's "sequence parallel",
    Ulysses); after construction read ``cp``.
    """

    world_size: int
    _: KW_ONLY
    tp: int = 1  # tensor parallel: each weight matrix split across tp ranks
    pp: int = 1  # pipeline parallel: layers split into pp stages
    cp: int = 1  # context / sequence parallel: each sequence split across cp ranks
    ep: int = 1  # expert parallel: experts split across ep ranks of each dp group
    sp: InitVar[int | None] = None  # alias for cp

    def __post_init__(self, sp: int | None) -> None:
        if sp is not None:
            if self.cp != 1 and self.cp != sp:
                raise ValueError(f"sp {sp} and cp {self.cp} name the same degree; give one")
            object.__setattr__(self, "cp", sp)
        for name in ("world_size", "tp", "pp", "cp", "ep"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        model = self.tp * self.pp * self.cp
        if self.world_size % model:
            raise ValueError(
                f"world_size {self.world_size} is not divisible by "
                f"tp {self.tp} x pp {self.pp} x cp {self.cp} = {model}; {launch_hint(model, self.world_size)}"
            )
        if self.dp % self.ep:
            raise ValueError(f"ep {self.ep} must divide dp {self.dp} (world_size / (tp x pp x cp)); use an ep "
                             f"that divides {self.dp}, or {launch_hint(model * self.ep, self.world_size)}")

    @classmethod
    def with_sp(cls, world_size: int, *, sp: int, tp: int = 1, pp: int = 1, ep: int = 1):
        """Construct with DeepSpeed's name for context parallelism."""
        return cls(world_size, tp=tp, pp=pp, cp=sp, ep=ep)

    # -- derived degrees ------------------------------------------------------------

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def edp(self) -> int:
        """Expert-data-parallel degree: how many dp ranks hold each expert shard."""
        return self.dp // self.ep

    def size(self, axis: str) -> int:
        """Number of ranks in each group of ``axis``."""
        _check_axis(axis)
        if axis == "dp_cp":
            return self.dp * self.cp
        return getattr(self, axis)

    @property
    def mesh_shape(self) -> tuple[int, int, int, int]:
        return (self.pp, self.dp, self.cp, self.tp)

    @property
    def mesh_dim_names(self) -> tuple[str, str, str, str]:
        return MESH_DIM_NAMES

    # -- rank <-> coordinates -------------------------------------------------------

    def rank_of(self, pp: int = 0, dp: int = 0, cp: int = 0, tp: int = 0) -> int:
        """Global rank at mesh coordinates ``(pp, dp, cp, tp)``."""
        for name, value in (("pp", pp), ("dp", dp), ("cp", cp), ("tp", tp)):
            size = getattr(self, name)
            if not 0 <= value < size:
                raise ValueError(f"{name} coordinate {value} out of range [0, {size})")
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinates of ``rank`` on every axis: its position in that axis's group."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} out of range [0, {self.world_size})")
        rest, tp = divmod(rank, self.tp)
        rest, cp = divmod(rest, self.cp)
        pp, dp = divmod(rest, self.dp)
        return {
            "pp": pp,
            "dp": dp,
            "cp": cp,
            "tp": tp,
            "dp_cp": dp * self.cp + cp,
            "ep": dp % self.ep,
            "edp": dp // self.ep,
        }

    # -- groups ---------------------------------------------------------------------

    def groups(self, axis: str) -> list[list[int]]:
        """All groups of ``axis``: a partition of ``range(world_size)``, each group
        sorted, groups ordered by their first rank. Every rank must create process
        groups from this list in this order."""
        _check_axis(axis)
        by_key: dict[tuple, list[int]] = {}
        for rank in range(self.world_size):  # ascending, so each group comes out sorted
            by_key.setdefault(self._group_key(axis, rank), []).append(rank)
        return sorted(by_key.values())

    def group_of(self, axis: str, rank: int) -> list[int]:
        """The group of ``axis`` that contains ``rank`` (built directly, O(group size))."""
        _check_axis(axis)
        c = self.coords(rank)
        at = {name: c[name] for name in MESH_DIM_NAMES}
        if axis in MESH_DIM_NAMES:
            points = [{**at, axis: i} for i in range(getattr(self, axis))]
        elif axis == "dp_cp":
            points = [{**at, "dp": d, "cp": k} for d in range(self.dp) for k in range(self.cp)]
        elif axis == "ep":  # the block of ep consecutive dp indices holding this rank
            first = c["edp"] * self.ep
            points = [{**at, "dp": first + i} for i in range(self.ep)]
        else:  # edp: every ep-th dp index, starting from this rank's ep coordinate
            points = [{**at, "dp": c["ep"] + i * self.ep} for i in range(self.edp)]
        return sorted(self.rank_of(**p) for p in points)

    def _group_key(self, axis: str, rank: int) -> tuple:
        """What ranks in one group of ``axis`` share: every coordinate except theirs."""
        c = self.coords(rank)
        if axis == "dp_cp":
            return (c["pp"], c["tp"])
        if axis in ("ep", "edp"):
            other = "edp" if axis == "ep" else "ep"
            return (c["pp"], c["cp"], c["tp"], c[other])
        return tuple(c[name] for name in MESH_DIM_NAMES if name != axis)

    def __str__(self) -> str:
        text = (
            f"{self.world_size} ranks = pp {self.pp} x dp {self.dp} x cp {self.cp} "
            f"x tp {self.tp}"
        )
        if self.ep > 1:
            text += f" (dp {self.dp} = ep {self.ep} x edp {self.edp})"
        return text


def _check_axis(axis: str) -> None:
    if axis not in AXES:
        raise ValueError(f"unknown axis {axis!r}; expected one of {', '.join(AXES)}")


def pipeline_stage(rank: int, world_size: int, pp: int) -> int:
    """The pipeline coordinate of `rank` in any layout of `world_size` ranks with `pp`
    stages: pipeline is the slowest axis, so stage s is the s-th block of world / pp
    consecutive ranks, whatever the other degrees are (Note [the mesh binds the stage] in
    parallel/pipeline/module.py uses it before the mesh exists)."""
    return rank // (world_size // pp)
