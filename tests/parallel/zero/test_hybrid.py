"""Units honour the groups they are given: hybrid sharding (state sharded over a group of
2, each shard replicated over the other 2 ranks of a world of 4) trains exactly like one
process on the whole batch. The strategy is driven as the engine drives it, with the norm
reduced over the groups it names (`StepGradients.groups`: the shard group only)."""

import pytest
import torch
import torch.distributed as dist

from meshspeed.optim.builder import ParamSelection
from meshspeed.optim.clip import clip_by_norm_, global_grad_norm
from meshspeed.parallel.zero.groups import UnitGroups
from meshspeed.parallel.zero.strategy import Zero
from meshspeed.testing import run_distributed
from meshspeed.testing.parity import (
    ParitySetup,
    assert_close_parity,
    build_model,
    make_batches,
    reference_run,
)


def _groups() -> UnitGroups:
    """Shard over {0,1} / {2,3}, replicate over {0,2} / {1,3} (every rank creates all)."""
    shards = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replicas = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    rank = dist.get_rank()
    return UnitGroups(shard=shards[rank // 2], replicate=replicas[rank % 2])


def _hybrid_run(setup: ParitySetup):
    model = build_model(setup)
    groups = _groups()
    strategy = Zero(model, groups, stage=setup.stage, persistence_threshold=0)
    block = setup.optimizer_block()["params"]
    opt = torch.optim.AdamW(ParamSelection.capture(None, model).groups(model, strategy.master_of), **block)
    rank = dist.get_rank()
    rows = slice(rank * setup.micro, (rank + 1) * setup.micro)
    losses = []
    for batch in make_batches(setup):
        tokens = batch[0][rows]
        strategy.begin_micro_step(True)
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        strategy.finish_backward()
        step = strategy.prepare_step()
        grads = [m.grad for m in step.masters]
        clip_by_norm_(grads, setup.clip, global_grad_norm(grads, step.groups))
        opt.step()
        opt.zero_grad(set_to_none=True)
        strategy.finish_step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / setup.world)
    params = list(model.parameters())
    token = strategy.gather_for_user(params)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    strategy.release_for_user(token)
    return losses, state


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_hybrid_sharding_matches_one_process(stage):
    setup = ParitySetup(world=4, stage=stage, steps=6)
    ref = reference_run(setup)
    for got in run_distributed(_hybrid_run, world_size=4, args=(setup,)):
        assert_close_parity(ref, got)
