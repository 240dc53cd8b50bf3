"""Expert parallelism through meshspeed.initialize against one process.

The reference (one process) holds all experts (ep_size 1) and, at every step, runs the
forward once per data-parallel rank's rows (routing and capacity are per rank, as on the
engine; with capacity large enough that nothing drops and noise/RTS off, each chunk is
routed exactly as its rank routes it), averaging the chunks' losses; the engine on N gloo
ranks (ep 2 x edp 1 on 2 ranks, ep 2 x edp 2 on 4) must give the same loss every step and
the same final parameters, the experts gathered by global id (ep_rank * local + i).

SGD (momentum, no Adam normalisation) keeps the comparison sensitive to the scale of the
expert gradients: DeepSpeed's old division by edp instead of dp (ep times too large)
fails it, and `test_expert_gradients_are_the_dp_mean` checks that scale directly.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from meshspeed.config import ConfigError
from meshspeed.moe.layer import MoE
from meshspeed.testing import param_forms, run_distributed

torch.set_num_threads(1)

VOCAB, D, SEQ, MICRO, EXPERTS, AUX = 32, 8, 8, 2, 4, 0.01


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(D, 16), nn.GELU(), nn.Linear(16, D))


class Block(nn.Module):
    """Attention-free: a residual MLP, then a residual MoE."""

    def __init__(self, ep: int, k: int):
        super().__init__()
        self.ln1, self.mlp = nn.LayerNorm(D), _mlp()
        self.ln2 = nn.LayerNorm(D)
        self.moe = MoE(D, _mlp(), num_experts=EXPERTS, ep_size=ep, k=k, capacity_factor=float(EXPERTS),
                       min_capacity=64, use_rts=False, top2_2nd_expert_sampling=False)

    def forward(self, x):
        x = x + self.mlp(self.ln1(x))
        y, l_aux, _ = self.moe(self.ln2(x))
        return x + y, l_aux


class TinyMoE(nn.Module):
    def __init__(self, ep: int = 1, k: int = 1, n_layer: int = 2):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(Block(ep, k) for _ in range(n_layer))
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids, targets):
        x, aux = self.emb(ids), 0.0
        for block in self.blocks:
            x, l_aux = block(x)
            aux = aux + l_aux
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten()) + AUX * aux


@dataclass(frozen=True)
class Setup:
    world: int = 2
    ep: int = 2
    k: int = 1
    stage: int = 0
    clip: float = 0.0
    steps: int = 3
    lr: float = 0.1
    gas: int = 1
    params_form: str = "parameters"  # how initialize gets model_parameters (testing/param_forms.py)
    weight_decay: float = 0.0

    def config(self) -> dict:
        return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": self.gas,
                "optimizer": {"type": "SGD", "params": {"lr": self.lr, "momentum": 0.9,
                                                        "weight_decay": self.weight_decay}},
                "gradient_clipping": self.clip, "steps_per_print": 10_000,
                "zero_optimization": {"stage": self.stage, "stage3_param_persistence_threshold": 0}}


def _local_model(setup: Setup, ep_rank: int) -> TinyMoE:
    """The reference's weights (built whole, ep 1), each rank keeping its own experts."""
    torch.manual_seed(0)
    whole, model = TinyMoE(1, setup.k), TinyMoE(setup.ep, setup.k)
    local = EXPERTS // setup.ep
    state = {}
    for key, value in whole.state_dict().items():
        g = _expert_id(key)
        if g is None:
            state[key] = value
        elif g // local == ep_rank:
            state[_with_expert_id(key, g % local)] = value
    model.load_state_dict(state)
    return model


_MARK = "deepspeed_experts."


def _expert_id(key: str) -> int | None:
    if _MARK not in key:
        return None
    return int(key.split(_MARK, 1)[1].split(".", 1)[0])


def _with_expert_id(key: str, i: int) -> str:
    head, tail = key.split(_MARK, 1)
    return f"{head}{_MARK}{i}.{tail.split('.', 1)[1]}"


def _batches(setup: Setup) -> torch.Tensor:
    dp = setup.world
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, VOCAB, (setup.steps, setup.gas, dp * MICRO, SEQ + 1), generator=g)


def reference(setup: Setup):
    torch.manual_seed(0)
    model = TinyMoE(1, setup.k)
    groups = param_forms.reference_groups(model, setup.params_form, setup.weight_decay)
    opt = torch.optim.SGD(groups, lr=setup.lr, momentum=0.9, weight_decay=setup.weight_decay)
    losses, first_grads, norms = [], None, []
    for batch in _batches(setup):
        # one chunk per data-parallel rank and micro-step, routed on its own
        chunks = [c for micro in batch for c in micro.split(MICRO)]
        loss = sum(model(c[:, :-1], c[:, 1:]) for c in chunks) / len(chunks)
        loss.backward()
        if first_grads is None:
            first_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        if setup.clip > 0:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), setup.clip)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {k: v.clone() for k, v in model.state_dict().items()}, first_grads, norms


def _global_state(engine, setup: Setup) -> dict[str, torch.Tensor]:
    """Whole parameters of every rank, experts renamed by global id, merged over ranks."""
    from meshspeed import comm
    from meshspeed.zero import GatheredParameters

    local, ep_rank = EXPERTS // setup.ep, engine.mesh.coord("ep")
    with GatheredParameters(list(engine.module.parameters())):
        state = {}
        for key, value in engine.module.state_dict().items():
            g = _expert_id(key)
            name = key if g is None else _with_expert_id(key, ep_rank * local + g)
            state[name] = value.detach().float().clone()
    merged: dict[str, torch.Tensor] = {}
    for part in comm.all_gather_object(state):
        merged.update(part)
    return merged


def _engine(setup: Setup):
    import meshspeed
    from meshspeed import comm

    ep_rank = comm.get_rank() % setup.ep  # the mesh's ep coordinate (dp fastest, ep innermost)
    model = _local_model(setup, ep_rank) if setup.ep > 1 else TinyMoE(1, setup.k)
    params = param_forms.model_parameters(model, setup.params_form, setup.weight_decay)
    engine, *_ = meshspeed.initialize(model=model, model_parameters=params, config=copy.deepcopy(setup.config()))
    assert engine.mesh.coord("ep") == ep_rank
    return engine


def engine_run(setup: Setup, save_dir: str | None = None):
    from meshspeed import comm

    engine = _engine(setup)
    dp_rank = engine.mesh.coord("dp")
    losses, norms = [], []
    for batch in _batches(setup):
        total = torch.zeros(())
        for micro in batch:
            rows = micro[dp_rank * MICRO:(dp_rank + 1) * MICRO]
            loss = engine(rows[:, :-1], rows[:, 1:])
            engine.backward(loss)
            engine.step()
            total += loss.detach()
        comm.all_reduce(total)
        losses.append(total.item() / (setup.world * setup.gas))
        if setup.clip > 0:
            norms.append(engine.get_global_grad_norm())
    if save_dir is not None:
        engine.save_checkpoint(save_dir, tag="t")
    return losses, _global_state(engine, setup), norms


def load_run(setup: Setup, save_dir: str):
    engine = _engine(setup)
    engine.load_checkpoint(save_dir, tag="t")
    return _global_state(engine, setup)


def engine_runs(setups):
    return [engine_run(s) for s in setups]


def _check(setups: list[Setup]) -> None:
    results = run_distributed(engine_runs, world_size=setups[0].world, args=(setups,), timeout=600)[0]
    for setup, (losses, state, norms) in zip(setups, results):
        ref_losses, ref_state, _, ref_norms = reference(setup)
        # the global norm counts every element once: dense shards over dp, experts over edp x ep
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=1e-6,
                                   msg=lambda m, s=setup: f"{s}: gradient norms differ: {m}")
        assert all(n > setup.clip for n in ref_norms)  # clipping was active
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6,
                                   msg=lambda m, s=setup: f"{s}: losses differ: {m}")
        assert state.keys() == ref_state.keys()
        for name in ref_state:
            torch.testing.assert_close(state[name], ref_state[name], rtol=1e-5, atol=1e-6,
                                       msg=lambda m, s=setup, n=name: f"{s}: parameter {n}: {m}")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_ep2_on_two_ranks_matches_one_process(stage):
    _check([Setup(world=2, ep=2, k=1, stage=stage), Setup(world=2, ep=2, k=2, stage=stage, clip=0.05)])


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_ep2_x_edp2_on_four_ranks_matches_one_process(stage):
    _check([Setup(world=4, ep=2, k=1, stage=stage), Setup(world=4, ep=2, k=2, stage=stage, clip=0.05)])


def test_every_form_of_model_parameters_trains_like_one_process():
    """Generator, filtered list, filter(...) and weight-decay groups (tests/engine/
    test_model_parameters.py): the expert layers are rebuilt per ep rank, the groups follow
    them by name."""
    _check([Setup(world=2, ep=2, stage=stage, params_form=form, weight_decay=0.05)
            for form in ("generator", "list", "filter", "groups") for stage in (0, 2)])


def test_ep4_with_gradient_accumulation_matches_one_process():
    _check([Setup(world=4, ep=4, k=2, stage=2, gas=2, clip=0.05), Setup(world=4, ep=4, k=1, stage=0, gas=2)])


@pytest.mark.parametrize("stage", [0, 2])
def test_expert_gradients_are_the_dp_mean(stage):
    """One SGD step of lr 1 from the reference's weights moves each parameter by minus its
    gradient: the experts' must be the mean over all dp ranks' losses (4 ranks, ep 2 x edp
    2), not ep times it (DeepSpeed's old division by edp)."""
    setup = Setup(world=4, ep=2, k=2, stage=stage, steps=1, lr=1.0)
    (_, state, _), = run_distributed(engine_runs, world_size=4, args=([setup],), timeout=600)[0]
    torch.manual_seed(0)
    before = TinyMoE(1, setup.k).state_dict()
    _, _, grads, _ = reference(setup)
    experts = [n for n in grads if _expert_id(n) is not None]
    assert len(experts) == 2 * EXPERTS * 4  # 2 blocks x 4 experts x (2 weights + 2 biases)
    for name in experts:
        torch.testing.assert_close(before[name] - state[name], grads[name], rtol=1e-5, atol=1e-6,
                                   msg=lambda m, n=name: f"expert gradient {n}: {m}")


class _SplitsExperts(nn.Sequential):
    """A plan that splits the experts' Linears (experts stay whole under tp: refused)."""

    tp_plan: ClassVar[dict] = {"0.deepspeed_moe.experts.deepspeed_experts.*.0": "column",
                               "0.deepspeed_moe.experts.deepspeed_experts.*.2": "row"}


def initialize_error(ep_sizes: tuple[int, ...], config: dict, cls: type = nn.Sequential) -> str:
    import meshspeed

    model = cls(*(MoE(D, _mlp(), num_experts=6, ep_size=ep) for ep in ep_sizes))
    base = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    try:
        meshspeed.initialize(model=model, config={**base, **config})
    except ConfigError as err:
        return str(err)
    return "no error"


def initialize_errors(cases) -> list[str]:
    return [initialize_error(*case) for case in cases]


def test_layouts_expert_parallelism_refuses_name_the_numbers():
    sp = {"tensor_parallel": {"autotp_size": 2, "sequence_parallel": True}}
    tp = {"tensor_parallel": {"autotp_size": 2}}
    cases = [((3,), {}), ((2, 3), {}), ((2,), {"sequence_parallel_size": 2}), ((2, 1), {}), ((1,), sp),
             ((1,), tp, _SplitsExperts)]
    not_dividing, mixed, with_cp, with_dense_moe, with_sp, split_experts = run_distributed(
        initialize_errors, world_size=2, args=(cases,), timeout=300)[0]
    assert "MoE ep_size 3 does not divide the data-parallel size 2" in not_dividing
    assert "different ep_size ('0' has ep_size 2, '1' has ep_size 3)" in mixed
    assert ("with context parallelism (size 2) is not supported in this version; expert parallelism "
            "composes with data, tensor parallelism and every ZeRO stage") in with_cp
    assert "'1' has ep_size 1, '0' has ep_size 2" in with_dense_moe
    # any MoE layer (ep_size 1 too) needs the whole sequence on every tp rank
    assert "tensor_parallel.sequence_parallel with MoE layers ('0', ...) is not supported" in with_sp
    assert ("0.deepspeed_moe.experts.deepspeed_experts.0.0.weight: the tensor-parallel plan splits a "
            "parameter of an MoE layer") in split_experts


@pytest.mark.parametrize("stage", [0, 2])
def test_checkpoint_reads_back_at_other_ep_dp_and_stage(tmp_path, stage):
    """Expert parameters are saved under their global expert id, so a checkpoint of ep 2
    on 2 ranks loads at ep 2 x edp 2 (4 ranks), at ep 4, and in one process (ep 1)."""
    path = str(tmp_path)
    saved = Setup(world=2, ep=2, k=1, stage=stage, steps=2)
    _, state, _ = run_distributed(engine_run, world_size=2, args=(saved, path), timeout=300)[0]
    from meshspeed.checkpoint.consolidate import consolidate

    whole = consolidate(path, tag="t")  # one process, no engine: every expert by global id
    assert whole.keys() == state.keys()
    for name in state:
        torch.testing.assert_close(whole[name].float(), state[name], rtol=0, atol=0)
    for world, ep, to_stage in ((2, 2, 3 - stage), (4, 2, 3), (4, 4, stage), (1, 1, 1)):
        setup = Setup(world=world, ep=ep, k=1, stage=to_stage)
        loaded = run_distributed(load_run, world_size=world, args=(setup, path), timeout=300)[0]
        assert loaded.keys() == state.keys()
        for name in state:
            torch.testing.assert_close(loaded[name], state[name], rtol=0, atol=0,
                                       msg=lambda m, n=name, s=setup: f"{s}: {n}: {m}")


def expert_groups_answer(setup: Setup):
    from meshspeed import comm
    from meshspeed.utils import groups

    engine = _engine(setup)
    name = engine.module.blocks[0].moe.expert_group_name
    layer_group = engine.module.blocks[0].moe.deepspeed_moe.ep_group
    try:
        groups._get_expert_parallel_group("ep_size_3")
        unknown = "no error"
    except KeyError as err:
        unknown = str(err)
    return (name, groups._get_expert_parallel_world_size(name), groups._get_expert_parallel_rank(name),
            groups._get_expert_data_parallel_world_size(name), groups._get_expert_data_parallel_rank(name),
            comm.get_world_size(layer_group), layer_group is groups._get_expert_parallel_group(name), unknown)


def test_deepspeed_expert_group_accessors_answer_from_the_mesh():
    answers = run_distributed(expert_groups_answer, world_size=4, args=(Setup(world=4, ep=2),), timeout=300)
    for rank, (name, ep, ep_rank, edp, edp_rank, layer_ep, same, unknown) in enumerate(answers):
        assert (name, ep, ep_rank, edp, edp_rank, layer_ep, same) == ("ep_size_2", 2, rank % 2, 2, rank // 2, 2, True)
        assert "No expert parallel group 'ep_size_3'" in unknown


def save_16bit_error(setup: Setup, path: str) -> str:
    from meshspeed.checkpoint.errors import CheckpointError

    engine = _engine(setup)
    try:
        engine.save_16bit_model(path)
    except CheckpointError as err:
        return str(err)
    return "no error"


def test_save_16bit_model_refuses_expert_parallelism(tmp_path):
    """It would write rank 0's experts only: refused on every rank, not a partial file."""
    answers = run_distributed(save_16bit_error, world_size=2, args=(Setup(), str(tmp_path)), timeout=300)
    assert all("save_16bit_model with expert parallelism (ep 2)" in a for a in answers)
    assert not list(tmp_path.iterdir())
