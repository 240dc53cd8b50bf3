"""1-bit Adam, 0/1 Adam and 1-bit LAMB converge like Adam on the demo's data: 2 gloo ranks, a small
byte-level GPT (2 layers, d_model 64, sequences of 32 bytes of the Python standard library,
the demo's corpus), micro-batch 8 per rank, 150 steps, lr 1e-3; compression from step 76.

Tolerances, on the final loss (mean of the last 20 steps; from 5.56, AdamW reaches 2.279):
* 1-bit Adam (freeze_step 75) vs the same optimizer never compressed (freeze_step 150):
  within 0.05 nats. This isolates what the 1-bit momentum costs; measured 2.307 vs 2.307.
* 1-bit Adam vs torch AdamW: at most 0.1 nats above (measured +0.028). The gap is not
  compression but DeepSpeed's 1-bit Adam update itself, which has no bias correction
  (Note [1-bit Adam's two phases] in meshspeed/optim/onebit.py).
* 0/1 Adam (var_freeze_step 75, then local steps: syncs every 1, 2, then 4 steps with
  local_step_scaler 20, local_step_clipper 4) takes more shortcuts: within 0.1 nats of the
  uncompressed 1-bit Adam (measured 2.339, +0.032) and 0.2 of AdamW (+0.060).
* 1-bit LAMB (lr 2e-2, LAMB's trust ratio wants a larger lr; freeze_step 75): at most 0.1
  nats above AdamW; measured 2.073 (never compressed: 2.104).
Five 2-rank runs: ~20 s on two idle CPU cores, ~35 s on busy ones.
"""

import torch

from meshspeed.testing import run_distributed

STEPS, SEQ, MICRO, LR = 150, 32, 8, 1e-3


def _train(opt_block: dict) -> list[float]:
    import meshspeed
    from meshspeed import comm
    from meshspeed.data import ByteWindows, stdlib_corpus
    from meshspeed.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, max_seq_len=SEQ, n_layer=2, n_head=2, d_model=64))
    config = {"train_micro_batch_size_per_gpu": MICRO, "optimizer": opt_block, "steps_per_print": 10**6}
    engine, *_ = meshspeed.initialize(model=model, config=config)
    data = ByteWindows(stdlib_corpus(400_000), SEQ)
    g = torch.Generator().manual_seed(1)
    world, rank = comm.get_world_size(), comm.get_rank()
    losses = []
    for _ in range(STEPS):
        picks = torch.randint(0, len(data), (world * MICRO,), generator=g)[rank * MICRO:(rank + 1) * MICRO]
        x, y = (torch.stack(t) for t in zip(*(data[int(i)] for i in picks)))
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        comm.all_reduce(mean, op="avg")
        losses.append(mean.item())
    return losses


def _final(opt_block: dict) -> tuple[float, float]:
    losses = run_distributed(_train, 2, args=(opt_block,))[0]
    return losses[0], sum(losses[-20:]) / 20


def test_compressed_optimizers_converge_like_adam():
    first, adamw = _final({"type": "AdamW", "params": {"lr": LR}})
    _, uncompressed = _final({"type": "OneBitAdam", "params": {"lr": LR, "freeze_step": STEPS}})
    _, onebit = _final({"type": "OneBitAdam", "params": {"lr": LR, "freeze_step": STEPS // 2}})
    assert onebit < first - 2.5, (first, onebit)  # it trains: ~5.56 -> ~2.3
    assert abs(onebit - uncompressed) < 0.05, (onebit, uncompressed)
    assert onebit < adamw + 0.1, (onebit, adamw)
    _, zero_one = _final({"type": "ZeroOneAdam", "params": {
        "lr": LR, "var_freeze_step": STEPS // 2, "local_step_scaler": 20, "local_step_clipper": 4}})
    assert zero_one < uncompressed + 0.1, (zero_one, uncompressed)
    assert zero_one < adamw + 0.2, (zero_one, adamw)
    _, lamb = _final({"type": "OneBitLamb", "params": {"lr": 2e-2, "freeze_step": STEPS // 2}})
    assert lamb < adamw + 0.1, (lamb, adamw)
