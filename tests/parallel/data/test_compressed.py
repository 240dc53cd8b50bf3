"""Compressed gradients in data parallelism (`gradient_compression`), world size 2, gloo.

Bytes per optimizer step are the all-gather of one fixed-size payload per bucket
(Note [ring bytes]: (N-1) x payload per rank), compared with the uncompressed all-reduce
of the same buckets; parameters stay bitwise identical on every rank; error feedback
conserves the sum on each rank; and a tiny byte-level GPT trained on the demo's corpus
ends within a stated tolerance of the uncompressed run.
"""

import math

import pytest
import torch

import meshspeed
from meshspeed import comm
from meshspeed.config import ConfigError, load_config
from meshspeed.engine.agreement import step_agreement_bytes
from meshspeed.models.gpt import GPT, GPTConfig
from meshspeed.testing import run_distributed

WORLD = 2


def _engine(compression, bucket=10**9, seed=0, **model):
    torch.manual_seed(seed)
    shape = {"vocab_size": 64, "max_seq_len": 16, "n_layer": 2, "n_head": 2, "d_model": 32} | model
    gpt = GPT(GPTConfig(**shape))
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}}, "gradient_clipping": 1.0,
              "zero_optimization": {"stage": 0, "reduce_bucket_size": bucket}}
    if compression is not None:
        config["gradient_compression"] = compression
    engine, *_ = meshspeed.initialize(model=gpt, model_parameters=gpt.parameters(), config=config)
    return engine


def _payload_bytes(method, n, ratio=0.01, chunk=256):
    """The formula of compress.py, written out again."""
    if method == "topk":
        return 8 * max(1, math.ceil(ratio * n))
    values = n if method == "int8" else math.ceil(n / 2)
    return math.ceil((4 * math.ceil(n / chunk) + values) / 4) * 4


def _volumes(compression, bucket):
    torch.set_num_threads(1)
    engine = _engine(compression, bucket)
    torch.manual_seed(1 + comm.get_rank())  # each rank its own data
    summaries = []
    for _ in range(3):
        tokens = torch.randint(0, 64, (4, 17))
        with comm.CommCounter() as c:
            engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
            engine.step()
        summaries.append(c.summary())
    numels = [b.flat.numel() for b in engine.strategy.buckets]
    params = torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()])
    return summaries, numels, params


CASES = [
    ({"method": "int8"}, "int8"),
    ({"method": "int4"}, "int4"),
    ({"method": "topk", "topk_ratio": 0.01}, "topk"),
]


@pytest.mark.parametrize("bucket", [10**9, 3000])
def test_bytes_per_step_follow_the_formula(bucket):
    plain, *compressed = [run_distributed(_volumes, world_size=WORLD, args=(c, bucket))
                          for c in [None] + [c for c, _ in CASES]]
    agree = step_agreement_bytes(WORLD)
    steps, numels, _ = plain[0]
    full = sum(round(2 * (WORLD - 1) / WORLD * 4 * n) for n in numels)  # the fp32 all-reduce
    assert steps[-1]["all_reduce"]["bytes"] == full + agree
    for (config, method), results in zip(CASES, compressed):
        steps, numels, _ = results[0]
        formula = sum((WORLD - 1) * _payload_bytes(method, n) for n in numels)
        for step in steps:
            assert step["all_gather"]["calls"] == len(numels)
            assert step["all_gather"]["bytes"] == formula, method
            assert step["all_reduce"]["bytes"] == agree  # only the step agreement
        ratio = formula / full
        bound = {"int8": 0.25 + 0.02, "int4": 0.125 + 0.02, "topk": 0.02 + 0.001 * len(numels)}[method]
        assert ratio <= bound, (method, ratio)
        # every rank holds the same parameters, bit for bit (Note [the same sum on every rank])
        assert torch.equal(results[0][2], results[1][2])


def _shard(n, world, chunk=256):
    return math.ceil(math.ceil(n / world) / chunk) * chunk


@pytest.mark.parametrize("world", [2, 4])
def test_two_hops_keep_the_all_reduce_factor(world):
    """all-gather of whole payloads: (N-1) P(n) per bucket; two hops: all-to-all + all-gather
    of shard payloads, 2 (N-1) P(s) with s = n / N rounded up to whole chunks."""
    agree = step_agreement_bytes(world)
    for method in ("int8", "int4"):
        one, two = (run_distributed(_volumes, world_size=world, args=(
            {"method": method, "exchange": exchange}, 10**9)) for exchange in ("all_gather", "two_hop"))
        numels = one[0][1]
        full = sum(round(2 * (world - 1) / world * 4 * n) for n in numels)
        hop = sum((world - 1) * _payload_bytes(method, _shard(n, world)) for n in numels)
        for step in two[0][0]:
            assert step["all_to_all"] == {"calls": len(numels), "bytes": hop}
            assert step["all_gather"] == {"calls": len(numels), "bytes": hop}
            assert step["all_reduce"]["bytes"] == agree
        gathered = one[0][0][-1]["all_gather"]["bytes"]
        assert gathered == sum((world - 1) * _payload_bytes(method, n) for n in numels)
        if world == 4:  # the saving of the second hop grows with N
            assert 2 * hop < gathered
        bound = {"int8": 0.25, "int4": 0.125}[method] * 1.1  # scales, shards padded to whole chunks
        assert 2 * hop / full <= bound, (method, 2 * hop / full)
        for rank in range(1, world):
            assert torch.equal(two[0][2], two[rank][2])


def _conserved(policy_args, n, steps):
    """Exchange random gradients `steps` times outside an engine; the summed output plus
    every residual left (summed over ranks) against the sum of every rank's gradients."""
    from meshspeed.parallel.data.compress import GradCompression, compressed_bucket

    torch.set_num_threads(1)
    bucket = compressed_bucket(GradCompression(**policy_args), n, torch.device("cpu"), None)
    gen = torch.Generator().manual_seed(comm.get_rank())
    inputs, outputs = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    for _ in range(steps):
        g = torch.randn(n, generator=gen) * torch.rand(n, generator=gen) ** 4
        inputs += g.double()
        bucket.launch(g, async_op=False)
        out = torch.empty(n)
        bucket.sum_into(out)
        outputs += out.double()
    comm.all_reduce(inputs, group=None)
    left = bucket.residual.double().clone()
    comm.all_reduce(left, group=None)
    if hasattr(bucket, "shard_residual"):  # each rank's residual of its summed shard
        shards = torch.empty(comm.get_world_size() * bucket.shard)
        comm.all_gather_into_tensor(shards, bucket.shard_residual)
        left += shards[:n].double()
    return (outputs + left - inputs).abs().max().item(), left.abs().max().item(), outputs


@pytest.mark.parametrize("policy", [{"method": "topk", "ratio": 0.05}, {"method": "int4"},
                                    {"method": "int8", "two_hop": True}, {"method": "int4", "two_hop": True}])
def test_error_feedback_conserves_the_sum_over_ranks(policy):
    results = run_distributed(_conserved, world_size=WORLD, args=(policy, 1001, 10))
    for err, left, _ in results:
        assert left > 0 and err < 1e-4
    assert torch.equal(results[0][2], results[1][2])  # every rank the same sum


def _warmup_and_feedback():
    torch.set_num_threads(1)
    engine = _engine({"method": "int4", "warmup_steps": 2})
    bucket = engine.strategy.buckets[0]
    residual = bucket.compressed.residual
    torch.manual_seed(1 + comm.get_rank())
    calls, sent, inputs = [], torch.zeros_like(residual, dtype=torch.float64), None
    for step in range(5):
        tokens = torch.randint(0, 64, (4, 17))
        with comm.CommCounter() as c:
            loss = engine(tokens[:, :-1], tokens[:, 1:])
            engine.backward(loss)
            grad = bucket.flat.detach().double().clone()  # this rank's gradient, before the step
            own = bucket.compressed.gathered
            if own is not None:
                bucket.work.wait()  # the all-gather runs under backward (overlap_comm)
                bucket.work = None  # decode this rank's payload: what it contributed
                payload = own.view(WORLD, -1)[comm.get_rank()]
                sent += bucket.compressed.codec.decode(payload).double()
                inputs = grad if inputs is None else inputs + grad
            engine.step()
        calls.append((c.summary()["all_gather"]["calls"], step))
    return calls, (sent + residual.double() - inputs).abs().max().item(), residual.abs().max().item()


def test_warmup_then_compression_with_error_feedback():
    for calls, err, size in run_distributed(_warmup_and_feedback, world_size=WORLD):
        assert [n for n, _ in calls] == [0, 0, 1, 1, 1]  # 2 warm-up steps all-reduce in full
        assert size > 0 and err < 1e-5 * max(1.0, size) + 1e-6  # sum sent + residual == sum of gradients


def test_refused_where_it_does_not_run():
    with pytest.raises(ConfigError, match="stage 0"):
        load_config({"gradient_compression": {"method": "int8"}, "zero_optimization": {"stage": 2}})
    with pytest.raises(ConfigError, match="fp16"):
        load_config({"gradient_compression": {"method": "int8"}, "fp16": {"enabled": True}})
    with pytest.raises(ConfigError, match="did you mean 'topk_ratio'"):
        load_config({"gradient_compression": {"method": "topk", "top_k_ratio": 0.1}})
    with pytest.raises(ConfigError, match="two_hop"):
        load_config({"gradient_compression": {"method": "topk", "exchange": "two_hop"}})
    with pytest.raises(ConfigError, match="topk_ratio is for"):
        load_config({"gradient_compression": {"method": "int4", "topk_ratio": 0.1}})


def _train(compression, steps):
    """Byte-level GPT on the demo's corpus; returns (mean loss of the last 20 steps,
    held-out loss), the same on both ranks."""
    from meshspeed.data.corpus import stdlib_corpus
    from meshspeed.data.dataset import ByteWindows

    torch.set_num_threads(1)
    train, val = ByteWindows(stdlib_corpus(300_000), seq_len=32).split(0.9)
    engine = _engine(compression, vocab_size=256, max_seq_len=32, n_layer=2, n_head=2, d_model=48)
    picks = torch.Generator().manual_seed(0)  # the same global batch order for every method
    losses = []
    for _ in range(steps):
        batch = torch.randint(0, len(train), (WORLD * 4,), generator=picks)
        mine = batch.view(WORLD, 4)[comm.get_rank()]
        x, y = (torch.stack(t) for t in zip(*(train[int(i)] for i in mine)))
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.eval()
    with torch.no_grad():
        x, y = (torch.stack(t) for t in zip(*(val[i] for i in range(64))))
        held_out = float(engine(x, y))
    return sum(losses[-20:]) / 20, held_out


# (method config, held-out loss tolerance over the uncompressed run, in nats)
CONVERGENCE = {
    "int8": ({"method": "int8"}, 0.05),
    "int4": ({"method": "int4"}, 0.1),
    "int4_two_hop": ({"method": "int4", "exchange": "two_hop"}, 0.1),
    "topk": ({"method": "topk", "topk_ratio": 0.1}, 0.2),
}


def _convergence(steps):
    runs = {"none": None} | {name: c for name, (c, _) in CONVERGENCE.items()}
    return {name: _train(c, steps) for name, c in runs.items()}


def test_convergence_close_to_uncompressed():
    """100 AdamW steps of a 2-layer byte GPT (d_model 48) on the demo's corpus, 2 ranks x
    4 sequences of 32 bytes; the held-out loss (64 windows never trained on) of each
    compressed run is within its tolerance of the uncompressed run's, same seed and data.

    Measured (2.220 uncompressed; initial ln 256 = 5.55): int8 +0.008, int4 +0.052, int4
    in two hops -0.007, top-k 10% +0.11. Tolerances are about twice those: quantization noise shrinks with the step
    (int8's grid is 18x finer than int4's), while top-k delays most coordinates' updates
    by ~1/ratio steps, which costs more in a run this short. Top-k 1% is far slower here
    (+0.85 at 100 steps, +0.53 at 150: each coordinate is sent about once in 100 steps
    and Adam normalises the delayed bursts away); it is not asserted, see
    docs/compression.md."""
    results = run_distributed(_convergence, world_size=WORLD, args=(100,))
    for name in results[0]:  # the held-out loss is the same on both ranks: same parameters
        assert results[0][name][1] == results[1][name][1], name
    held_out = {name: loss for name, (_, loss) in results[0].items()}
    assert held_out["none"] < 2.5  # it learnt: well below ln 256 and the unigram entropy
    for name, (_, tolerance) in CONVERGENCE.items():
        assert held_out[name] - held_out["none"] < tolerance, (name, held_out)


def test_lossless_topk_trains_as_the_all_reduce():
    """top-k with ratio 1 sends every element: the decoded sum is the all-reduce's sum, so
    the training matches uncompressed data parallelism (the plumbing: buckets, views,
    averaging by the data-parallel size)."""
    plain = run_distributed(_volumes, world_size=WORLD, args=(None, 3000))
    full = run_distributed(_volumes, world_size=WORLD, args=({"method": "topk", "topk_ratio": 1.0}, 3000))
    for a, b in zip(plain, full):
        torch.testing.assert_close(b[2], a[2], rtol=1e-6, atol=1e-7)


def _resumed(compression, tmp, steps=6, cut=3):
    """Losses and final parameters of `steps` steps, straight through or saved at `cut`
    and loaded into a fresh engine (Note [rank-local state])."""
    def batch(i):
        g = torch.Generator().manual_seed(100 * i + comm.get_rank())
        t = torch.randint(0, 64, (4, 17), generator=g)
        return t[:, :-1], t[:, 1:]

    def run(engine, first, last):
        out = []
        for i in range(first, last):
            loss = engine(*batch(i))
            engine.backward(loss)
            engine.step()
            out.append(loss.item())
        return out

    straight = _engine(compression)
    losses = run(straight, 0, steps)
    first = _engine(compression)
    resumed = run(first, 0, cut)
    first.save_checkpoint(tmp, tag="cut")
    second = _engine(compression, seed=1)  # other initial weights: all of it comes from the file
    second.load_checkpoint(tmp, tag="cut")
    resumed += run(second, cut, steps)
    same = all(torch.equal(a, b) for a, b in zip(straight.module.parameters(), second.module.parameters()))
    return losses, resumed, same


@pytest.mark.parametrize("exchange", ["all_gather", "two_hop"])
def test_a_resumed_run_continues_its_residuals_and_warmup(tmp_path, exchange):
    """The residuals (both hops') and the warm-up count travel in the checkpoint: saved at
    step 3 of 6 (warm-up 2) and resumed, the run is the uninterrupted one, bit for bit."""
    policy = {"method": "int4", "warmup_steps": 2, "exchange": exchange}
    straight, resumed, same = run_distributed(_resumed, world_size=WORLD, args=(policy, str(tmp_path)))[0]
    assert resumed == straight and same
