"""ZeRO++ qgZ (zero_quantized_gradients): the INT4 exchange in one process, then on 2 gloo
ranks the bytes of every unit's gradient reduction against the formula, and training the
tiny GPT at stages 2 and 3 next to the plain reduce-scatter."""

import math

import pytest
import torch

import meshspeed
from meshspeed import comm
from meshspeed.comm import counter as comm_counter
from meshspeed.config import ConfigError, load_config
from meshspeed.models.gpt import GPT, GPTConfig
from meshspeed.parallel.access import safe_get_full_fp32_param
from meshspeed.parallel.zero.qgz import GRAD_BLOCK, GradientExchange
from meshspeed.testing import run_distributed
from tests.parallel.zero.corpus import train_and_hold_out


def test_config_takes_the_key_at_stages_2_and_3_and_refuses_it_below():
    for stage in (2, 3):
        cfg = load_config({"zero_optimization": {"stage": stage, "zero_quantized_gradients": True}})
        assert cfg.zero_optimization.zero_quantized_gradients
    for stage in (0, 1):
        with pytest.raises(ConfigError, match=f"stage {stage} has none"):
            load_config({"zero_optimization": {"stage": stage, "zero_quantized_gradients": True}})


def test_pieces_decode_within_half_a_step_and_sum_in_fp32():
    """The sum of the decoded pieces is within sum of half-steps (max|x| / 14 per block) of
    the exact sum; a block's largest magnitude is exact."""
    n, world = 1000, 3
    ex = GradientExchange(n, world)
    assert ex.payload_bytes == 4 * math.ceil(4 * math.ceil(n / GRAD_BLOCK) + n / 2) // 4
    g = torch.Generator().manual_seed(0)
    pieces = [torch.randn(n, generator=g) for _ in range(world)]
    recv = torch.stack([ex.codec.encode(p) for p in pieces])
    got = ex.summed(recv)
    bound = sum(
        torch.nn.functional.pad(p, (0, 4 * GRAD_BLOCK - n)).view(4, GRAD_BLOCK).abs().amax(1)
        .repeat_interleave(GRAD_BLOCK)[:n] / 14 for p in pieces)
    assert torch.all((got - sum(pieces)).abs() <= bound * (1 + 1e-5))


CFG = GPTConfig(vocab_size=64, max_seq_len=16, n_layer=2, n_head=2, d_model=32)


class _Calls:
    def __init__(self):
        self.calls = []

    def on_collective(self, op, nbytes, seconds):
        if op in ("reduce_scatter", "all_to_all"):
            self.calls.append((op, nbytes))


def _engine(stage, qgz, precision="fp32", model=CFG, lr=1e-3, micro=2):
    torch.manual_seed(0)
    net = GPT(model)
    config = {
        "train_micro_batch_size_per_gpu": micro,
        "optimizer": {"type": "AdamW", "params": {"lr": lr}},
        "zero_optimization": {"stage": stage, "zero_quantized_gradients": qgz},
        "gradient_clipping": 1.0,
    }
    if precision != "fp32":
        config[precision] = {"enabled": True}
    if precision == "bf16":
        config["communication_data_type"] = "bf16"  # the plain reduce-scatter in bf16
    engine, *_ = meshspeed.initialize(model=net, model_parameters=net.parameters(), config=config)
    return engine


def _reduce_bytes(stage, qgz, precision):
    engine = _engine(stage, qgz, precision)
    g = torch.Generator().manual_seed(comm.get_rank())
    tokens = torch.randint(0, CFG.vocab_size, (2, 17), generator=g)
    calls = _Calls()
    comm_counter.attach(calls)
    engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
    engine.step()
    comm_counter.detach(calls)
    shards = [u.shard_numel for u in engine.strategy.units]
    payloads = [u.grad_exchange.payload_bytes for u in engine.strategy.units] if qgz else None
    return calls.calls, shards, payloads


@pytest.mark.parametrize("stage, precision, elt", [(3, "bf16", 2), (2, "fp32", 4)])
def test_each_unit_reduction_is_one_all_to_all_of_int4_shards(stage, precision, elt):
    """Per unit one all-to-all moving (N-1)/N * N P bytes, P = align4(S/2 + 4 ceil(S/B)),
    instead of one reduce-scatter moving (N-1)/N * N S e bytes."""
    n = 2
    plain, shards, _ = run_distributed(_reduce_bytes, world_size=n, args=(stage, False, precision))[0]
    quant, shards_q, payloads = run_distributed(_reduce_bytes, world_size=n, args=(stage, True, precision))[0]
    assert shards == shards_q and len(plain) == len(quant) == len(shards) > 0
    assert {op for op, _ in plain} == {"reduce_scatter"} and {op for op, _ in quant} == {"all_to_all"}
    # units reduce in backward's order (the head first), not in the units' order
    assert sorted(p for _, p in plain) == sorted((n - 1) * s * elt for s in shards)
    for s, pb in zip(shards, payloads):
        assert pb == 4 * math.ceil((4 * math.ceil(s / GRAD_BLOCK) + math.ceil(s / 2)) / 4)
    assert sorted(q for _, q in quant) == sorted((n - 1) * pb for pb in payloads)
    ratio = sum(q for _, q in quant) / sum(p for _, p in plain)
    # int4 values are 1/4 of bf16's bytes and 1/8 of fp32's; the scales add 4/256 per element
    want = (0.5 + 4 / GRAD_BLOCK) / elt
    assert want * 0.99 < ratio < want * 1.01, ratio


TRAIN_CFG = GPTConfig(vocab_size=256, max_seq_len=32, n_layer=2, n_head=2, d_model=64)


def _train(stage, qgz, steps):
    """Per-step losses, the held-out loss, and every parameter's full fp32 master."""
    engine = _engine(stage, qgz, "bf16", model=TRAIN_CFG, lr=1e-3, micro=4)
    losses, held = train_and_hold_out(engine, steps, micro=4, seq=32)
    masters = {name: safe_get_full_fp32_param(p).clone() for name, p in engine.module.named_parameters()}
    return losses, held, masters


@pytest.mark.parametrize("stage", [2, 3])
def test_training_follows_the_plain_reduce_scatter(stage):
    """bf16 GPT (2 blocks, d_model 64) on the stdlib byte corpus, 2 ranks x 4 windows of
    32 bytes, 100 AdamW steps (lr 1e-3), then the loss on 64 held-out windows.

    Each rank's INT4 piece of a gradient is within half a step (max|g| / 14 of its block of
    256) of the exact value, without error feedback (as DeepSpeed's qgZ); AdamW normalises
    the update by the second moment, so the per-step noise moves each weight by at most
    about lr and does not compound. Asserted: held-out loss within 2% of plain (the
    spread of plain training over another data order is about 0.2%, qwZ's test), both
    below half the first loss; the full masters are the same on both ranks."""
    plain = run_distributed(_train, world_size=2, args=(stage, False, 100))
    quant = run_distributed(_train, world_size=2, args=(stage, True, 100))
    (pl, plain_held, _), (ql, quant_held, masters) = plain[0], quant[0]
    assert ql[0] == pl[0]  # the first forward precedes any gradient
    assert abs(quant_held - plain_held) < 0.02 * plain_held, (plain_held, quant_held)
    assert quant_held < 0.5 * ql[0] and plain_held < 0.5 * pl[0]
    other = quant[1][2]
    for name in masters:
        assert torch.equal(masters[name], other[name]), name
    print(f"stage {stage}: first {pl[0]:.4f}, held-out plain {plain_held:.4f} qgZ {quant_held:.4f}")


def test_a_non_finite_gradient_stays_non_finite_for_the_overflow_check():
    """fp16 loss scaling skips a step on inf/NaN in the reduced gradient: an inf or NaN in
    any rank's piece makes its block's scale non-finite, so the decoded sum is too."""
    ex = GradientExchange(600, 2)
    for bad in (float("inf"), float("nan")):
        x = torch.randn(600)
        x[300] = bad
        got = ex.summed(torch.stack([ex.codec.encode(x), ex.codec.encode(torch.randn(600))]))
        assert not torch.isfinite(got[256:512]).all() and torch.isfinite(got[:256]).all()


def _accumulating(zero, steps=10):
    torch.manual_seed(0)
    net = GPT(CFG)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "bf16": {"enabled": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}}, "zero_optimization": zero}
    engine, *_ = meshspeed.initialize(model=net, model_parameters=net.parameters(), config=config)
    g = torch.Generator().manual_seed(comm.get_rank())
    tokens = torch.randint(0, CFG.vocab_size, (2, 17), generator=g)
    losses = []
    for _ in range(2 * steps):
        loss = engine(tokens[:, :-1], tokens[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def test_with_accumulation_qwz_and_optimizer_offload():
    """Two micro-steps per step (each reduced by its own all-to-all and accumulated into the
    shard), with qwZ on the gathers, and with the optimizer on the host (the summed shard
    moved to an fp32 host copy): training goes down, and offload changes nothing."""
    qgz = {"stage": 3, "zero_quantized_gradients": True}
    both = run_distributed(_accumulating, world_size=2, args=({**qgz, "zero_quantized_weights": True},))[0]
    base = run_distributed(_accumulating, world_size=2, args=(qgz,))[0]
    host = run_distributed(_accumulating, world_size=2,
                           args=({**qgz, "offload_optimizer": {"device": "cpu"}},))[0]
    assert both[-1] < 0.8 * both[0] and base[-1] < 0.8 * base[0]
    assert host == base


# -- two hops (Note [qgZ's two hops]) -------------------------------------------------------


class _Groups:
    def __init__(self):
        self.calls = []

    def on_collective(self, op, nbytes, seconds):
        pass

    def on_group(self, op, nbytes, ranks):
        if op == "all_to_all":
            self.calls.append((nbytes, tuple(sorted(ranks))))


def _hops(per_node, hpz):
    """Every all-to-all of one step on 4 ranks, with `per_node` ranks a machine (the
    launcher's LOCAL_WORLD_SIZE) or hpZ's partition of `hpz`; and the payload size."""
    import os

    before = os.environ.get("LOCAL_WORLD_SIZE")
    os.environ["LOCAL_WORLD_SIZE"] = str(per_node)
    try:
        torch.manual_seed(0)
        net = GPT(CFG)
        config = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                  "zero_optimization": {"stage": 3, "zero_quantized_gradients": True,
                                        "zero_hpz_partition_size": hpz}}
        engine, *_ = meshspeed.initialize(model=net, model_parameters=net.parameters(), config=config)
    finally:
        os.environ["LOCAL_WORLD_SIZE"] = before
    g = torch.Generator().manual_seed(comm.get_rank())
    tokens = torch.randint(0, CFG.vocab_size, (2, 17), generator=g)
    calls = _Groups()
    comm_counter.attach(calls)
    engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
    engine.step()
    comm_counter.detach(calls)
    grads = {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}
    return calls.calls, [u.grad_exchange.payload_bytes for u in engine.strategy.units], grads


@pytest.mark.parametrize("per_node, hpz", [(2, 1), (4, 2)])
def test_across_nodes_two_hops_move_a_node_size_less(per_node, hpz):
    """4 ranks as 2 nodes of 2 (from the launcher's ranks per node, or hpZ's partition):
    per unit, hop 1 inside the node moves (L-1) G P, hop 2 among the ranks at the same
    place moves (G-1) P; one hop moved (N-1) P, (N-L) P of it across nodes."""
    n, per, nodes_ = 4, 2, 2
    one, payloads, after_one = run_distributed(_hops, world_size=n, args=(4, 1))[0]
    two, payloads2, after_two = run_distributed(_hops, world_size=n, args=(per_node, hpz))[0]
    assert payloads == payloads2 and len(one) == len(payloads) and len(two) == 2 * len(payloads)
    assert all(g == (0, 1, 2, 3) for _, g in one)  # in backward's order, not the units'
    assert sorted(b for b, _ in one) == sorted((n - 1) * p for p in payloads)
    # a unit's hop 2 runs when its reduction is collected, so later units' hop 1 may come first
    hop1 = sorted(b for b, g in two if g == (0, 1))  # rank 0: node {0, 1}
    hop2 = sorted(b for b, g in two if g == (0, 2))  # place 0 of both nodes
    assert hop1 == sorted((per - 1) * nodes_ * p for p in payloads)
    assert hop2 == sorted((nodes_ - 1) * p for p in payloads)
    across_one = sum((n - per) * p for p in payloads)
    across_two = sum(b for b, g in two if g == (0, 2))
    assert across_two * per == across_one
    # the sum is quantized twice: the step's update differs, by at most about lr per weight
    for name, value in after_one.items():
        assert (after_two[name] - value).abs().max() <= 2.5e-3, name
