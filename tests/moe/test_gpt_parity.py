"""The reference GPT's MoE variant through meshspeed.initialize against one process.

Every other block of a 2-block GPT (d_model 32, seq 16) is an MoE of 4 SwiGLU experts,
with capacity enough that nothing drops. The engine runs it at ep 2 on 2 ranks, ep 2 x
edp 2 on 4 and ep 2 x tp 2 on 4 (the dense layers tensor-parallel, the experts whole on
each tp rank), ZeRO 0-3, top-1 and top-2; the reference is one process holding every
expert (ep_size 1). Same seed, same data, fp32: the loss of every step, the global
gradient norm (clipping active on the top-2 runs) and the final parameters within 1e-5.

Routing is per rank, so the reference runs the forward once per data-parallel rank's
rows and averages. Random token selection and second-expert sampling stay ON: every rank
is seeded differently before initialize, initialize gives the tp ranks tp rank 0's
generator (Note [MoE layers on tensor-parallel ranks] in engine/build.py), and the
reference draws each dp rank's chunk from the generator state that rank had after
initialize. Any rank whose tp peers routed differently, or a gradient scaled or reduced
wrongly (SGD with momentum keeps the comparison scale-sensitive), fails the comparison.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass

import pytest
import torch

from meshspeed.models.gpt import GPT, GPTConfig
from meshspeed.testing import run_distributed

torch.set_num_threads(1)

VOCAB, SEQ, MICRO, EXPERTS, STEPS = 64, 16, 2, 4, 3
_MARK = "deepspeed_experts."


@dataclass(frozen=True)
class Case:
    world: int
    tp: int = 1
    k: int = 1
    stage: int = 0
    clip: float = 0.0
    save: bool = False  # save a checkpoint after training (consolidated by the test)
    ep: int = 2
    lr: float = 0.1

    @property
    def dp(self) -> int:
        return self.world // self.tp

    def gpt(self, ep: int) -> GPTConfig:
        return GPTConfig(vocab_size=VOCAB, max_seq_len=SEQ, n_layer=2, n_head=2, d_model=32,
                         moe_num_experts=EXPERTS, moe_top_k=self.k, moe_ep_size=ep,
                         moe_capacity_factor=float(EXPERTS))  # every token fits: nothing drops

    def config(self) -> dict:
        cfg = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 10_000,
               "optimizer": {"type": "SGD", "params": {"lr": self.lr, "momentum": 0.9}},
               "gradient_clipping": self.clip,
               "zero_optimization": {"stage": self.stage, "stage3_param_persistence_threshold": 0}}
        if self.tp > 1:
            cfg["tensor_parallel"] = {"autotp_size": self.tp}
        return cfg


def _cases(world: int, tp: int, stages=(0, 1, 2, 3)) -> list[Case]:
    # top-2 runs clip (below these gradient norms: clipping acts at every step)
    return [Case(world, tp=tp, k=k, stage=s, clip=0.05 if k == 2 else 0.0,
                 save=tp > 1 and s == 2 and k == 1) for s in stages for k in (1, 2)]


EP2 = _cases(2, tp=1)
EP2_EDP2 = _cases(4, tp=1)
EP2_TP2 = _cases(4, tp=2)


def _expert_id(key: str) -> int | None:
    return int(key.split(_MARK, 1)[1].split(".", 1)[0]) if _MARK in key else None


def _with_expert_id(key: str, i: int) -> str:
    head, tail = key.split(_MARK, 1)
    return f"{head}{_MARK}{i}.{tail.split('.', 1)[1]}"


def _batches(case: Case) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, VOCAB, (STEPS, case.dp * MICRO, SEQ + 1), generator=g)


def reference(case: Case, rng_states: list[torch.Tensor]):
    """One process, all experts local; dp rank d's rows routed from d's generator."""
    torch.manual_seed(0)
    model = GPT(case.gpt(ep=1))
    opt = torch.optim.SGD(model.parameters(), lr=case.lr, momentum=0.9)
    states, losses, norms = list(rng_states), [], []
    for batch in _batches(case):
        chunks = []
        for d, rows in enumerate(batch.split(MICRO)):
            torch.set_rng_state(states[d])
            chunks.append(model(rows[:, :-1], rows[:, 1:]))
            states[d] = torch.get_rng_state()
        loss = torch.stack(chunks).mean()
        loss.backward()
        if case.clip > 0:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), case.clip)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, norms


# -- the engine side (runs on every rank) --------------------------------------------------------


def _local_model(case: Case, ep_rank: int) -> GPT:
    """The reference's weights (built whole, ep 1), this ep rank keeping its own experts."""
    torch.manual_seed(0)
    whole, model = GPT(case.gpt(ep=1)), GPT(case.gpt(ep=case.ep))
    local, state = EXPERTS // case.ep, {}
    for key, value in whole.state_dict().items():
        g = _expert_id(key)
        if g is None:
            state[key] = value
        elif g // local == ep_rank:
            state[_with_expert_id(key, g % local)] = value
    model.load_state_dict(state)
    return model


def _global_state(engine, case: Case) -> dict[str, torch.Tensor]:
    """Whole parameters (tp pieces gathered), experts named by global id, merged over all
    ranks; every rank holding a parameter (tp and edp replicas) must hold the same values."""
    from meshspeed import comm
    from meshspeed.testing.parity import logical_state
    from meshspeed.zero import GatheredParameters

    local, ep_rank = EXPERTS // case.ep, engine.mesh.coord("ep")
    with GatheredParameters(list(engine.module.parameters())):
        state = {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}
        state = logical_state(engine.module, state, engine.mesh.group("tp"))
    state = {k if _expert_id(k) is None else _with_expert_id(k, ep_rank * local + _expert_id(k)): v
             for k, v in state.items()}
    merged: dict[str, torch.Tensor] = {}
    for part in comm.all_gather_object(state):
        for name, value in part.items():
            if name in merged:
                assert torch.equal(merged[name], value), f"{case}: replicas of {name} differ"
            merged[name] = value
    return merged


def engine_run(case: Case, save_dir: str | None):
    import meshspeed
    from meshspeed import comm
    from meshspeed.topology import ParallelDims

    rank = comm.get_rank()
    ep_rank = ParallelDims(case.world, tp=case.tp, ep=case.ep).coords(rank)["ep"]
    model = _local_model(case, ep_rank)
    torch.manual_seed(1000 + rank)  # each rank its own stream: initialize aligns the tp ranks
    engine, *_ = meshspeed.initialize(model=model, config=copy.deepcopy(case.config()))
    assert engine.mesh.coord("ep") == ep_rank
    rng = torch.get_rng_state()
    dp_rank, losses, norms = engine.mesh.coord("dp"), [], []
    for batch in _batches(case):
        rows = batch[dp_rank * MICRO:(dp_rank + 1) * MICRO]
        loss = engine(rows[:, :-1], rows[:, 1:])
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        comm.all_reduce(total)
        losses.append(total.item() / case.world)
        if case.clip > 0:
            norms.append(engine.get_global_grad_norm())
    if case.save:
        engine.save_checkpoint(save_dir, tag="t")
    return losses, _global_state(engine, case), norms, rng


def engine_runs(cases: list[Case], save_dir: str | None) -> list:
    return [engine_run(c, save_dir) for c in cases]


def _results(world: int, save_dir: str) -> dict[Case, tuple]:
    """One distributed call per world size for every case of that size (a failure too is
    kept, so that the other cases' tests report it without running it again)."""
    got = _run(world, save_dir)
    if isinstance(got, BaseException):
        raise got
    return got


@functools.cache
def _run(world: int, save_dir: str) -> dict[Case, tuple] | BaseException:
    cases = [c for c in EP2 + EP2_EDP2 + EP2_TP2 if c.world == world]
    try:
        per_rank = run_distributed(engine_runs, world_size=world, args=(cases, save_dir), timeout=600)
    except Exception as err:  # noqa: BLE001 - re-raised by every test of this world size
        return err
    # rank 0's results, and every rank's generator state after initialize
    return {case: (*per_rank[0][i][:3], [per_rank[r][i][3] for r in range(world)])
            for i, case in enumerate(cases)}


@pytest.fixture(scope="module")
def save_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("moe_gpt"))


def _check(case: Case, save_dir: str) -> None:
    losses, state, norms, rngs = _results(case.world, save_dir)[case]
    for r in range(case.world):  # initialize gave every tp rank its tp rank 0's generator
        assert torch.equal(rngs[r], rngs[r - r % case.tp]), f"{case}: rank {r}'s generator"
    ref_losses, ref_state, ref_norms = reference(case, [rngs[d * case.tp] for d in range(case.dp)])
    if case.clip > 0:  # the global norm counts every element once (experts: over edp x ep, once over tp)
        assert all(n > case.clip for n in ref_norms)
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{case}: gradient norms differ: {m}")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6,
                               msg=lambda m: f"{case}: losses differ: {m}")
    assert state.keys() == ref_state.keys()
    for name in ref_state:
        torch.testing.assert_close(state[name], ref_state[name], rtol=1e-5, atol=1e-6,
                                   msg=lambda m, n=name: f"{case}: parameter {n}: {m}")
    if case.save:  # each expert saved once, by its global id
        import math

        from meshspeed.checkpoint.consolidate import consolidate
        from meshspeed.checkpoint.metadata import read_meta
        from meshspeed.checkpoint.paths import resolve

        params = read_meta(resolve(save_dir, "t"))["params"]
        experts = {n: p for n, p in params.items() if _expert_id(n) is not None}
        assert len(experts) == EXPERTS * 3  # one MoE block, 3 weights an expert
        for name, p in experts.items():  # whole on every tp rank: one range set, no duplicate
            assert not any(r.get("tp") for r in p["ranges"])
            assert sum(r["end"] - r["start"] for r in p["ranges"]) == math.prod(p["shape"]), name
        whole = consolidate(save_dir, tag="t")
        assert whole.keys() == state.keys()
        for name in state:
            torch.testing.assert_close(whole[name].float(), state[name], rtol=0, atol=0)


def _id(case: Case) -> str:
    return f"stage{case.stage}-top{case.k}"


@pytest.mark.parametrize("case", EP2, ids=_id)
def test_ep2_on_two_ranks(case, save_dir):
    _check(case, save_dir)


@pytest.mark.parametrize("case", EP2_EDP2, ids=_id)
def test_ep2_x_edp2_on_four_ranks(case, save_dir):
    _check(case, save_dir)


@pytest.mark.parametrize("case", EP2_TP2, ids=_id)
def test_ep2_x_tp2_on_four_ranks(case, save_dir):
    _check(case, save_dir)
