"""Tensor-parallel checkpoint round trips, on every rank of `run_distributed`.

The real tensor-parallel layers are not on this branch, so `TinyTP` splits its parameters
by hand: each tp rank holds its pieces (cut from the same seeded logical tensors) and
announces them in `tp_shards`, as the layers will. Its "loss" is elementwise,
    sum((w * c)^2 + w * d)   over every parameter (c, d: fixed logical tensors, cut alike),
so every logical element's gradient, Adam moments and value depend on that element only:
a run at any tp x dp layout must match the tp=1 reference exactly, element by element, and
padding (w = c = d = 0) stays zero. No tensor-parallel collective is needed in forward.

The engine is composed like `meshspeed.initialize` but with the topology's dp group
(initialize still uses the whole world as the dp group), so ZeRO shards each rank's LOCAL
parameters over its dp group: the real tp x dp layout, with `engine.topology` attached.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn

from meshspeed import comm
from meshspeed.checkpoint.snapshot import ordered_slices
from meshspeed.topology.shards import TPShard, even_pieces

# name -> (logical shape, split dim or None (replicated), fused parts along dim or None)
PARAMS = {
    "col.weight": ((8, 6), 0, None),  # column parallel
    "col.bias": ((8,), 0, None),
    "row.weight": ((5, 8), 1, None),  # row parallel: split along dim 1
    "row.bias": ((5,), None, None),  # replicated
    "qkv.weight": ((12, 4), 0, (4, 4, 4)),  # fused q | k | v: three pieces per rank
    "emb.weight": ((13, 4), 0, None),  # a vocabulary of 13: padded at tp 2 and 4
    "norm.weight": ((4,), None, None),
}


def logical(name: str, what: str) -> torch.Tensor:
    """The logical tensors every layout starts from: 'init' values, loss factors 'c', 'd'."""
    shape = PARAMS[name][0]
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}/{what}".encode()))
    return torch.randn(shape, generator=g)


def shard_for(name: str, tp_rank: int, tp: int) -> TPShard | None:
    shape, dim, parts = PARAMS[name]
    if dim is None or tp == 1:
        return None
    pieces, local = even_pieces(shape[dim], tp_rank, tp, parts=parts)
    return TPShard(dim, shape, pieces, local, tp_rank, tp)


class Part(nn.Module):
    def __init__(self, names: dict[str, str], tp_rank: int, tp: int):
        super().__init__()
        self.tp_shards = {}
        for attr, name in names.items():
            shard = shard_for(name, tp_rank, tp)

            def cut(t: torch.Tensor, shard=shard) -> torch.Tensor:
                return shard.local_from_logical(t) if shard is not None else t.clone()

            setattr(self, attr, nn.Parameter(cut(logical(name, "init"))))
            self.register_buffer(f"{attr}_c", cut(logical(name, "c")), persistent=False)
            self.register_buffer(f"{attr}_d", cut(logical(name, "d")), persistent=False)
            if shard is not None:
                self.tp_shards[attr] = shard

    def forward(self) -> torch.Tensor:
        loss = 0
        for attr, p in self.named_parameters(recurse=False):
            c, d = getattr(self, f"{attr}_c"), getattr(self, f"{attr}_d")
            loss = loss + ((p * c) ** 2 + p * d).sum()
        return loss


class TinyTP(nn.Module):
    def __init__(self, tp_rank: int = 0, tp: int = 1):
        super().__init__()
        parts: dict[str, dict[str, str]] = {}
        for name in PARAMS:
            mod, attr = name.split(".")
            parts.setdefault(mod, {})[attr] = name
        for mod, names in parts.items():
            setattr(self, mod, Part(names, tp_rank, tp))

    def forward(self) -> torch.Tensor:
        return sum(m() for m in self.children())


def config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": {"lr": 0.05, "weight_decay": 0.01}},
            "steps_per_print": 10**9}


def tp_engine(tp: int, stage: int, attach: bool = True):
    """A tp x dp engine over this world (dp = world / tp) through `meshspeed.initialize`,
    which builds the mesh from `tensor_parallel.autotp_size` and, the model being split
    already (its layers list `tp_shards`), leaves it as it is. `attach` is kept for the
    callers: every engine now carries its topology (tp 1 when not split)."""
    import meshspeed
    from meshspeed.topology import ParallelDims, build_topology

    del attach
    topo = build_topology(ParallelDims(comm.get_world_size(), tp=tp))  # the mesh initialize will use
    model = TinyTP(topo.coord("tp"), tp)
    cfg = {**config(stage), "tensor_parallel": {"autotp_size": tp}}
    engine, *_ = meshspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    if engine.topology is not topo:
        raise AssertionError("initialize built another mesh for the same layout")
    return engine


def train(engine, steps: int) -> None:
    for _ in range(steps):
        loss = engine()
        engine.backward(loss)
        engine.step()


def owned(engine) -> list[dict]:
    """This rank's ranges, for comparison with the reference in the test process."""
    state = engine.optimizer.state
    out = []
    for s in ordered_slices(engine):
        st = state.get(s.key, {})
        out.append({"name": s.name, "tp": s.tp, "start": s.start, "end": s.end,
                    "master": s.master.detach().reshape(-1).clone(),
                    **{k: st[k].detach().reshape(-1).clone() for k in ("exp_avg", "exp_avg_sq")
                       if k in st}})
    return out


# -- worker entry points --------------------------------------------------------------------------
def reference(steps: list[int]) -> dict[int, dict]:
    """tp=1, dp=1, stage 0: logical masters and Adam moments after each of `steps`."""
    engine = tp_engine(1, 0, attach=False)
    out, done = {}, 0
    for n in steps:
        train(engine, n - done)
        done = n
        out[n] = {r["name"]: r for r in owned(engine)}
    return out


def save(save_dir: str, tp: int, stage: int, steps: int, export: str | None = None) -> dict:
    engine = tp_engine(tp, stage)
    train(engine, steps)
    engine.save_checkpoint(save_dir)
    if export:
        engine.save_16bit_model(export)
    return {"rank": comm.get_rank(), "tp_rank": engine.topology.coord("tp")}


def load(save_dir: str, tp: int, stage: int, more: int, attach: bool = True) -> dict:
    engine = tp_engine(tp, stage, attach=attach)
    engine.load_checkpoint(save_dir)
    loaded = owned(engine)
    train(engine, more)
    return {"loaded": loaded, "after": owned(engine), "steps": engine.global_steps}


def load_error(save_dir: str, tp: int, stage: int) -> str | None:
    from meshspeed.checkpoint import CheckpointError

    engine = tp_engine(tp, stage)
    try:
        engine.load_checkpoint(save_dir)
    except CheckpointError as err:
        return str(err)
    return None


def save_without_topology(save_dir: str) -> str | None:
    """Layers announce tp=2 pieces but the engine's mesh has no tp axis: a one-line error."""
    import torch.distributed as dist

    from meshspeed.checkpoint import CheckpointError
    from meshspeed.topology import ParallelDims, build_topology

    engine = tp_engine(2, 1)
    engine.topology = build_topology(ParallelDims(dist.get_world_size()))
    try:
        engine.save_checkpoint(save_dir)
    except CheckpointError as err:
        return str(err)
    return None
