"""ZeRO++ hpZ (zero_hpz_partition_size): the config and the node layout in one process,
then on 4 gloo ranks as 2 "nodes" of 2: the same run as plain stage 3 bit for bit, the
backward gathers inside the node (0 bytes across it), the memory the secondary copy
costs, and a stale copy never used."""

import pytest
import torch

import meshspeed
from meshspeed import comm
from meshspeed.comm import counter as comm_counter
from meshspeed.config import ConfigError, load_config
from meshspeed.models.gpt import GPT, GPTConfig
from meshspeed.parallel.access import safe_get_full_fp32_param, safe_set_full_fp32_param
from meshspeed.parallel.zero import nodes
from meshspeed.testing import DistributedTestError, run_distributed

WORLD, NODE = 4, 2


def test_config_takes_the_key_at_stage_3_and_refuses_it_elsewhere():
    assert load_config({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 8}}) \
        .zero_optimization.zero_hpz_partition_size == 8
    with pytest.raises(ConfigError, match="stage 2 keeps its parameters whole"):
        load_config({"zero_optimization": {"stage": 2, "zero_hpz_partition_size": 2}})
    with pytest.raises(ConfigError, match="positive number of ranks"):
        load_config({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 0}})


def test_node_layouts_of_hpz_and_qgz():
    assert nodes.blocks([[0, 1, 2, 3, 4, 5, 6, 7]], 4) == [[[0, 1, 2, 3], [4, 5, 6, 7]]]
    two = nodes.blocks([[0, 2, 4, 6], [1, 3, 5, 7]], 2)  # dp 4 x tp 2: dp groups are strided
    assert nodes.inside(two) == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert nodes.across(two) == [[0, 4], [2, 6], [1, 5], [3, 7]]
    assert nodes.by_node([[0, 2, 4, 6], [1, 3, 5, 7]], 4) == two  # 4 ranks a machine: the same
    with pytest.raises(ValueError, match="does not divide the ZeRO group of 4 ranks"):
        nodes.blocks([[0, 1, 2, 3]], 3)
    with pytest.raises(ValueError, match=r"has \[1, 2\] ranks on different nodes"):
        nodes.by_node([[0, 1, 2]], 2)


CFG = GPTConfig(vocab_size=64, max_seq_len=16, n_layer=2, n_head=2, d_model=32)


def _engine(hpz, precision="fp32", accumulate=1, extra=None):
    torch.manual_seed(0)
    net = GPT(CFG)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": accumulate,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
        "zero_optimization": {"stage": 3, "zero_hpz_partition_size": hpz, **(extra or {})},
        "gradient_clipping": 1.0,
    }
    if precision != "fp32":
        config[precision] = {"enabled": True}
    engine, *_ = meshspeed.initialize(model=net, model_parameters=net.parameters(), config=config)
    return engine


def _batch(step):
    g = torch.Generator().manual_seed(1000 * step + comm.get_rank())
    tokens = torch.randint(0, CFG.vocab_size, (2, CFG.max_seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _run(hpz, precision, accumulate, steps, poke, extra=None):
    """Losses and full masters after `steps` micro-steps; `poke`: between the two
    micro-steps of step 1 every weight is written from outside (safe_set_full_fp32_param)."""
    engine = _engine(hpz, precision, accumulate, extra)
    losses = []
    for i in range(steps):
        loss = engine(*_batch(i))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if poke and i == accumulate:  # inside step 1: its second micro-step uses the new values
            for p in engine.module.parameters():
                safe_set_full_fp32_param(p, safe_get_full_fp32_param(p) * 0.5)
    masters = {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}
    return losses, masters


OFFLOAD = {"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}


@pytest.mark.parametrize("precision, accumulate, poke, extra", [
    ("fp32", 1, False, None), ("bf16", 2, True, None), ("bf16", 2, False, OFFLOAD)])
def test_trains_bit_for_bit_as_plain_stage_3(precision, accumulate, poke, extra):
    """Backward (and, with accumulation, the later micro-steps) gathers the slots copied
    from forward's gather: the same weights, so the same run (Note [what the secondary copy
    holds]). The poke writes every weight between micro-steps: a copy kept past it would
    give the second micro-step the old weights and another loss. With the shards in host
    memory (offload_param) the first gather reads them from there and the rest do not."""
    steps = 4 * accumulate
    plain = run_distributed(_run, world_size=WORLD, args=(1, precision, accumulate, steps, poke, extra))
    hpz = run_distributed(_run, world_size=WORLD, args=(NODE, precision, accumulate, steps, poke, extra))
    for rank in range(WORLD):
        assert hpz[rank][0] == plain[rank][0], rank
        for name, value in plain[rank][1].items():
            assert torch.equal(hpz[rank][1][name], value), name


class _Calls:
    def __init__(self):
        self.calls = []

    def on_collective(self, op, nbytes, seconds):
        pass

    def on_group(self, op, nbytes, ranks):
        self.calls.append((op, nbytes, tuple(sorted(ranks))))


def _pass_calls(hpz):
    """Per pass (forward, backward, step) of the second step: (op, bytes, group ranks)."""
    engine = _engine(hpz, "bf16")
    x, y = _batch(0)
    engine.backward(engine(x, y))
    engine.step()  # warm-up: the unit order for prefetch is recorded
    out = {}
    for name in ("forward", "backward", "step"):
        calls = _Calls()
        comm_counter.attach(calls)
        if name == "forward":
            loss = engine(x, y)
        elif name == "backward":
            engine.backward(loss)
        else:
            engine.step()
        comm_counter.detach(calls)
        out[name] = calls.calls
    units = engine.strategy.units
    resident = {k: sum(t.numel() * t.element_size() for t in v) for k, v in engine.strategy.memory_tensors().items()}
    return out, [u.layout.padded_numel for u in units if u.shard_params], resident


def test_backward_gathers_stay_inside_the_node_and_the_copy_costs_a_kth():
    """Per rank, with N = 4 ranks, K = 2 per node and M the gathered bytes of a unit:
    forward gathers over all N as before ((N-1)/N M each); backward's gathers run inside the
    node group ((K-1)/K M each, the same calls as plain): 0 bytes across nodes. Gradients
    still reduce over all N (qgZ's part). The secondary slots add M/K per unit to the
    resident parameters, next to the primary shard's M/N."""
    plain, padded, plain_mem = run_distributed(_pass_calls, world_size=WORLD, args=(1,))[0]
    hpz, padded_h, hpz_mem = run_distributed(_pass_calls, world_size=WORLD, args=(NODE,))[0]
    world, node = tuple(range(WORLD)), (0, 1)  # rank 0's node
    assert padded == padded_h
    assert hpz["forward"] == plain["forward"]
    assert {g for op, _, g in plain["forward"] if op == "all_gather"} == {world}
    back_p = [(op, b) for op, b, g in plain["backward"] if op == "all_gather"]
    back_h = [(op, b, g) for op, b, g in hpz["backward"] if op == "all_gather"]
    assert len(back_p) == len(back_h) > 0
    assert {g for _, _, g in back_h} == {node}
    for (_, bp), (_, bh, _) in zip(back_p, back_h):
        m = bp * WORLD // (WORLD - 1)  # plain moved (N-1)/N of the unit's M bytes
        assert bh == m * (NODE - 1) // NODE
    assert sum(b for _, b, g in hpz["backward"] if not set(g) <= set(node)) == \
        sum(b for op, b, g in plain["backward"] if op != "all_gather")  # the reduce-scatters only
    assert [c for c in hpz["step"]] == [c for c in plain["step"]]
    extra = hpz_mem["params"] - plain_mem["params"]
    primary = sum(n // WORLD * 2 for n in padded)  # bf16: 2 bytes an element
    assert extra == sum(n // NODE * 2 for n in padded) == primary * WORLD // NODE, (extra, padded)


def _user_gather_under_qwz():
    """qwZ + hpZ: after a forward the slots of the released units hold dequantized
    weights; a user's gather of those units in between must still see the shards' exact
    values. (The root unit stays whole from forward to backward with its quantized weights,
    with or without hpZ: GatheredParameters finds it whole and gathers nothing.)"""
    from meshspeed.parallel.zero.lifecycle import ParamState
    from meshspeed.zero import GatheredParameters

    engine = _engine(NODE, "fp32", extra={"zero_quantized_weights": True})
    x, y = _batch(0)
    loss = engine(x, y)  # fills the slots with quantized weights
    unit_of = engine.strategy.unit_of
    params = [p for p in engine.module.parameters() if unit_of[id(p)].state is ParamState.SHARDED]
    fresh = all(unit_of[id(p)].secondary.fresh for p in params)
    with GatheredParameters(params):
        seen = [p.detach().clone() for p in params]
    exact = [safe_get_full_fp32_param(p) for p in params]
    engine.backward(loss)
    engine.step()
    return len(params) > 0 and fresh and all(torch.equal(a, b) for a, b in zip(seen, exact))


def test_a_user_gather_under_qwz_reads_the_exact_shards():
    assert all(run_distributed(_user_gather_under_qwz, world_size=WORLD))


def _not_a_divisor():
    _engine(3)


def test_a_size_that_does_not_divide_the_zero_group_is_an_error():
    with pytest.raises(DistributedTestError, match="zero_hpz_partition_size 3 does not divide the ZeRO group"):
        run_distributed(_not_a_divisor, world_size=WORLD)
