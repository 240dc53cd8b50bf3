"""ZeRO++ qwZ (zero_quantized_weights): the block codec in one process, then on 2 gloo
ranks the bytes of every stage-3 all-gather against the formula, exact gathers for the
user, and training next to plain stage 3."""

import math

import pytest
import torch

import meshspeed
from meshspeed import comm
from meshspeed.comm import counter as comm_counter
from meshspeed.config import ConfigError, load_config
from meshspeed.models.gpt import GPT, GPTConfig
from meshspeed.parallel.access import safe_get_full_fp32_param
from meshspeed.parallel.zero.qwz import BLOCK, QMAX, BlockQuantizer
from meshspeed.testing import run_distributed
from tests.parallel.zero.corpus import train_and_hold_out


def _values(n, seed=0):
    g = torch.Generator().manual_seed(seed)  # magnitudes over 3 decades, as across blocks of weights
    return torch.randn(n, generator=g) * torch.logspace(-3, 0, n)[torch.randperm(n, generator=g)]


@pytest.mark.parametrize("n, block", [(1, 256), (7, 256), (256, 256), (1000, 256), (5000, BLOCK)])
def test_round_trip_within_half_a_step(n, block):
    codec = BlockQuantizer(n, block)
    x = _values(n)
    payload = codec.encode(x)
    assert payload.dtype == torch.uint8 and payload.numel() == codec.payload_bytes == n + 4 * math.ceil(n / block)
    y = codec.decode(payload)
    padded = torch.nn.functional.pad(x, (0, codec.blocks * block - n)).view(codec.blocks, block)
    step = (padded.abs().amax(1) / QMAX).repeat_interleave(block)[:n]
    assert torch.all((x - y).abs() <= step / 2 * (1 + 1e-5))
    top = padded.abs().argmax(1) + torch.arange(codec.blocks) * block  # +-QMAX steps: exact
    top = top[top < n]
    torch.testing.assert_close(y[top], x[top], rtol=1e-6, atol=0)


def test_bf16_decodes_to_the_rounded_fp32_values_and_zero_blocks_stay_zero():
    codec = BlockQuantizer(600, 256)
    x = _values(600, seed=1).to(torch.bfloat16)
    x[256:512] = 0  # a whole block of zeros: scale 0, decoded zeros, no NaN
    payload = codec.encode(x)
    assert torch.equal(codec.decode(payload, torch.bfloat16), codec.decode(payload).to(torch.bfloat16))
    assert torch.equal(codec.decode(payload)[256:512], torch.zeros(256))


def test_a_payload_at_an_unaligned_offset_decodes():
    codec = BlockQuantizer(7, 4)  # 7 + 8 = 15 bytes: rank 1's payload starts at byte 15
    x, z = _values(7, seed=2), _values(7, seed=3)
    gathered = torch.cat([codec.encode(x), codec.encode(z)])
    out = torch.empty(14)
    codec.decode_gathered(out, gathered)
    assert torch.equal(out[:7], codec.decode(codec.encode(x))) and torch.equal(out[7:], codec.decode(codec.encode(z)))


def test_config_refuses_qwz_below_stage_3_and_keeps_nontrainable_weights_refused():
    assert load_config({"zero_optimization": {"stage": 3, "zero_quantized_weights": True}}) \
        .zero_optimization.zero_quantized_weights
    with pytest.raises(ConfigError, match="zero_quantized_weights quantizes the parameter all-gathers of stage 3"):
        load_config({"zero_optimization": {"stage": 2, "zero_quantized_weights": True}})
    with pytest.raises(ConfigError, match="which meshspeed does not implement yet"):
        load_config({"zero_optimization": {"stage": 3, "zero_quantized_weights": True,
                                           "zero_quantized_nontrainable_weights": True}})


# -- 2 ranks -------------------------------------------------------------------------------
CFG = GPTConfig(vocab_size=64, max_seq_len=16, n_layer=2, n_head=2, d_model=32)


class _Calls:
    """Every all-gather's bytes, in order (CommCounter sums them)."""

    def __init__(self):
        self.gathers = []

    def on_collective(self, op, nbytes, seconds):
        if op == "all_gather":
            self.gathers.append(nbytes)


def _engine(qwz, precision="fp32", model=CFG, lr=1e-3, micro=2):
    torch.manual_seed(0)
    net = GPT(model)
    config = {
        "train_micro_batch_size_per_gpu": micro,
        "optimizer": {"type": "AdamW", "params": {"lr": lr}},
        "zero_optimization": {"stage": 3, "zero_quantized_weights": qwz},
        "gradient_clipping": 1.0,
    }
    if precision != "fp32":
        config[precision] = {"enabled": True}
    engine, *_ = meshspeed.initialize(model=net, model_parameters=net.parameters(), config=config)
    return engine


def _batch(step=0, vocab=CFG.vocab_size, seq=16):
    g = torch.Generator().manual_seed(1000 * step + comm.get_rank())
    tokens = torch.randint(0, vocab, (2, seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _gather_bytes(qwz, precision):
    engine = _engine(qwz, precision)
    x, y = _batch()
    engine.backward(engine(x, y))
    engine.step()  # warm-up: the unit order for prefetch is recorded
    calls = _Calls()
    comm_counter.attach(calls)
    with comm.CommCounter() as counter:
        engine.backward(engine(x, y))
        engine.step()
    comm_counter.detach(calls)
    return calls.gathers, counter.summary()["all_gather"]


@pytest.mark.parametrize("n, precision, elt, ratio", [(2, "bf16", 2, 0.5), (2, "fp32", 4, 0.25),
                                                     (4, "bf16", 2, 0.5)])
def test_each_gather_moves_int8_values_and_fp32_scales(n, precision, elt, ratio):
    """One all-gather per unit use, as without qwZ (values and scales in one payload), each
    moving (N-1)(S + 4 ceil(S/B)) bytes instead of (N-1) S e."""
    plain, plain_sum = run_distributed(_gather_bytes, world_size=n, args=(False, precision))[0]
    quant, quant_sum = run_distributed(_gather_bytes, world_size=n, args=(True, precision))[0]
    assert len(quant) == len(plain) == plain_sum["calls"] == quant_sum["calls"] > 0
    for p, q in zip(plain, quant):
        shard = p // ((n - 1) * elt)  # S: a plain gather moves (N-1) S e bytes
        assert p == (n - 1) * shard * elt
        assert q == (n - 1) * (shard + 4 * math.ceil(shard / BLOCK))
        assert q / p > ratio
    assert quant_sum["bytes"] == sum(quant)
    assert quant_sum["bytes"] / plain_sum["bytes"] < ratio * 1.01  # scales: < 1% on these units


def _working_and_exact():
    engine = _engine(True, "bf16")
    x, y = _batch()
    engine.backward(engine(x, y))
    engine.step()
    block = engine.module.layers[0]
    seen = []
    hook = block.register_forward_pre_hook(lambda m, args: seen.append(  # after the gather
        [p.detach().float().clone() for p in m.parameters()]))
    engine.eval()
    with torch.no_grad():
        engine(x, y)
    hook.remove()
    masters = [safe_get_full_fp32_param(p).to(torch.bfloat16).float() for p in block.parameters()]
    with meshspeed.zero.GatheredParameters(list(block.parameters())):
        exact = [p.detach().float().clone() for p in block.parameters()]
    unit = engine.strategy.unit_of[id(next(block.parameters()))]
    unit.gather_async()  # a quantized prefetch in flight when the user asks: gathered again, exact
    with meshspeed.zero.GatheredParameters(list(block.parameters())):
        again = [p.detach().float().clone() for p in block.parameters()]
    assert all(torch.equal(a, e) for a, e in zip(again, exact))
    return seen[0], exact, masters


def test_training_gathers_are_quantized_and_a_user_gather_is_exact():
    """Forward computes with the decoded INT8 weights; GatheredParameters returns the
    shards' own values (DeepSpeed's user gathers are not quantized either), which are the
    bf16-rounded fp32 masters."""
    working, exact, masters = run_distributed(_working_and_exact, world_size=2)[0]
    for e, m in zip(exact, masters):
        assert torch.equal(e, m)
    working, exact = torch.cat([w.flatten() for w in working]), torch.cat([e.flatten() for e in exact])
    # a quantization block may span several parameters of the unit: bound by the unit's
    # largest magnitude, half a step (max / 254) plus the rounding of the decoded value to bf16
    top = exact.abs().max()
    assert (working - exact).abs().max() <= top / (2 * QMAX) + top * 2**-8
    assert not torch.equal(working, exact)


TRAIN_CFG = GPTConfig(vocab_size=256, max_seq_len=32, n_layer=2, n_head=2, d_model=64)


def _train(qwz, steps):
    """Per-step training losses, then the loss on the held-out windows (the same on every
    rank and in both runs)."""
    engine = _engine(qwz, "bf16", model=TRAIN_CFG, lr=1e-3, micro=4)
    return train_and_hold_out(engine, steps, micro=4, seq=32)


def test_training_follows_plain_stage_3():
    """bf16 GPT (2 blocks, d_model 64) on the stdlib byte corpus, 2 ranks x 4 windows of
    32 bytes, 100 AdamW steps (lr 1e-3), then the loss on 64 held-out windows.

    Each gathered working weight is within half a step (max|w| / 254 of its block) of the
    shard's value, while the fp32 masters and every update stay exact, so qwZ perturbs each
    step's forward and backward without compounding. Measured: held-out loss 2.542 (plain)
    and 2.538 (qwZ) from 5.54 at the start, 0.17% apart, about the spread of plain stage 3
    itself over another order of the same data (0.2% in a trial). Asserted: within 1%, and
    both below half the first loss."""
    plain, plain_held = run_distributed(_train, world_size=2, args=(False, 100))[0]
    quant, quant_held = run_distributed(_train, world_size=2, args=(True, 100))[0]
    assert abs(quant[0] - plain[0]) < 0.01 * plain[0]  # the first forward: quantized weights only
    assert abs(quant_held - plain_held) < 0.01 * plain_held, (plain_held, quant_held)
    assert quant_held < 0.5 * quant[0] and plain_held < 0.5 * plain[0]


def test_with_param_offload_trains_bit_for_bit_as_without(tmp_path):
    """The shard a gather encodes may come from host memory or from a swap file, read in
    pieces into the unit's own range (Note [shards larger than a staging buffer]): the same
    values, so the same payloads and the same run."""
    from tests.offload.workers import exact_adamw, offload, runs_and_cleanup, setup

    qwz = {"zero_quantized_weights": True}
    cpu = {**qwz, "offload_param": {"device": "cpu"}, **offload("cpu")}
    nvme = {**qwz, **offload("cpu"), "offload_param": {"device": "nvme", "nvme_path": str(tmp_path),
                                                       "buffer_count": 2, "buffer_size": 1024}}
    setups = [setup(3, zero, precision="bf16", extra_config=exact_adamw()) for zero in ({}, qwz, cpu, nvme)]
    plain, base, on_cpu, on_nvme = run_distributed(runs_and_cleanup, world_size=2, args=(setups,), timeout=300)[0]
    assert base[0] != plain[0]  # qwZ is on (the losses differ from plain stage 3's)
    for got in (on_cpu, on_nvme):
        assert got[0] == base[0]
        for name in base[1]:
            assert torch.equal(got[1][name], base[1][name]), name
