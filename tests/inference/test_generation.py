"""`generate` against references, token for token (fp32, greedy):

* HF GPT-2 and HF Llama (GQA) against Hugging Face's own `generate` (max_new_tokens=16),
  unbatched and batched prompts of different lengths (left padding + attention_mask),
  with the paged and the contiguous cache;
* meshspeed's GPT against `GPT.generate(idx, n, temperature=0)`;
* tp=2 (two gloo ranks, `apply_tensor_parallel`) against the unsplit model;
* stop tokens against the rule applied to an unstopped run; seeded sampling reproducible
  and independent of the batch; top-k=1 equal to greedy; the input errors.
"""

from __future__ import annotations

import copy

import pytest
import torch

from meshspeed.inference.generation import generate
from meshspeed.inference.runners import runner_for
from meshspeed.testing import run_distributed
from tests.inference.models import EOS, FAMILIES, PAD, build, forward_logits

NEW = 16


def _batch(vocab: int, lengths=(9, 4, 6), seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded (B, T) ids (prompt tokens avoid EOS/PAD) and their attention mask."""
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids, mask = torch.full((len(lengths), T), PAD), torch.zeros(len(lengths), T, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, T - n:] = torch.randint(2, vocab, (n,), generator=g)
        mask[i, T - n:] = 1
    return ids, mask


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_hf_generate_parity(family):
    torch.manual_seed(0)
    model = build(family)
    ids, mask = _batch(128)
    kw = {"max_new_tokens": NEW, "eos_token_id": EOS, "pad_token_id": PAD}
    ref_batch = model.generate(ids, attention_mask=mask, do_sample=False, **kw)
    ref_one = model.generate(ids[:1], do_sample=False, **kw)
    assert ref_batch.shape[1] > ids.shape[1] + 8  # the comparison covers real generation
    for cache in ("paged", "contiguous"):
        assert torch.equal(generate(model, ids, mask, cache=cache, block_size=4, **kw), ref_batch), cache
        assert torch.equal(generate(model, ids[:1], cache=cache, **kw), ref_one), cache
        assert torch.equal(generate(model, ids[0], cache=cache, **kw), ref_one), cache


def test_gpt_generate_parity():
    torch.manual_seed(0)
    model = build("gpt")
    ids, _ = _batch(128, lengths=(7, 7))
    ref = model.generate(ids, NEW, temperature=0)
    for cache in ("paged", "contiguous"):
        assert torch.equal(generate(model, ids, max_new_tokens=NEW, cache=cache, block_size=4), ref)
        assert torch.equal(generate(model, ids[1], max_new_tokens=NEW, cache=cache), ref[1:])


def _tp_run(family: str) -> dict:
    """On each of 2 ranks: the unsplit model's outputs, then the tp=2 split's."""
    from meshspeed.tensor_parallel import apply_tensor_parallel
    from meshspeed.topology.degrees import ParallelDims
    from meshspeed.topology.mesh import build_topology

    torch.manual_seed(0)
    model = build(family)
    ids, mask = _batch(128)
    prompts = [ids[i][mask[i].bool()] for i in range(len(ids))]

    def outputs(m):
        out = {c: generate(m, ids, mask, max_new_tokens=NEW, cache=c, block_size=4)
               for c in ("paged", "contiguous")}
        runner = runner_for(m)
        out["prefill"] = runner.prefill(runner.new_cache("paged", 3, 16), [0, 1, 2], prompts)
        return out

    ref = outputs(copy.deepcopy(model))
    apply_tensor_parallel(model, build_topology(ParallelDims(2, tp=2)))
    split = sum(hasattr(m, "tp_shards") for m in model.modules())
    torch.manual_seed(0)
    sp_model = apply_tensor_parallel(build(family), build_topology(ParallelDims(2, tp=2)),
                                     sequence_parallel=True)
    try:
        runner_for(sp_model)
        sp_error = None
    except ValueError as exc:
        sp_error = str(exc)
    return {"ref": ref, "tp": outputs(model), "split_modules": split, "sp_error": sp_error}


@pytest.mark.parametrize("family", FAMILIES)
def test_tensor_parallel_same_tokens(family):
    for res in run_distributed(_tp_run, world_size=2, args=(family,)):
        assert res["split_modules"] >= 8  # the model really was split
        assert "split with sequence_parallel or overlap_comm" in res["sp_error"]
        for cache in ("paged", "contiguous"):
            assert torch.equal(res["tp"][cache], res["ref"][cache]), cache
        torch.testing.assert_close(res["tp"]["prefill"], res["ref"]["prefill"], rtol=1e-5, atol=1e-5)


def test_prefill_logits_equal_forward():
    torch.manual_seed(0)
    model = build("llama")
    ids, mask = _batch(128)
    runner = runner_for(model)
    prompts = [ids[i][mask[i].bool()] for i in range(len(ids))]
    logits = runner.prefill(runner.new_cache("contiguous", 3, 16), [0, 1, 2], prompts)
    for i, p in enumerate(prompts):
        torch.testing.assert_close(logits[i], forward_logits(model, p)[-1], rtol=1e-5, atol=1e-5)


def test_stop_tokens_pad_and_end_early():
    torch.manual_seed(0)
    model = build("llama")
    ids, mask = _batch(128, lengths=(5, 8))
    free = generate(model, ids, mask, max_new_tokens=NEW)  # no stop tokens
    T, new = ids.shape[1], free[:, ids.shape[1]:]
    stop = int(new[0, 2])  # row 0 emits it at step 2 (or earlier)
    got = generate(model, ids, mask, max_new_tokens=NEW, stop_token_ids=[stop], pad_token_id=PAD)
    want = new.clone()
    ends = []
    for row in want:  # the rule: keep up to and including the first stop token, pad after
        hits = (row == stop).nonzero().flatten()
        end = int(hits[0]) + 1 if len(hits) else NEW
        row[end:] = PAD
        ends.append(end)
    assert ends[0] <= 3
    assert torch.equal(got, torch.cat((ids, want[:, :max(ends)]), 1))
    alone = generate(model, ids[:1], mask[:1], max_new_tokens=NEW, eos_token_id=stop)
    assert alone.shape == (1, T + ends[0])  # ends as soon as every sequence stopped


def test_seeded_sampling_reproducible_and_batch_independent():
    torch.manual_seed(0)
    model = build("gpt2")
    prompts = [torch.tensor([5, 6, 7, 8, 9]), torch.tensor([10, 11]), torch.tensor([3, 4, 12])]
    kw = {"max_new_tokens": NEW, "do_sample": True, "temperature": 0.9, "top_k": 50, "top_p": 0.95}
    a = generate(model, prompts, seed=7, **kw)
    b = generate(model, prompts, seed=7, **kw)
    assert torch.equal(a, b)
    assert a.shape == (3, 5 + NEW) and torch.equal(a[1, :3], torch.full((3,), 0))  # list front padded
    alone = generate(model, prompts[1], seed=8, **kw)  # row 1 of the batch drew from seed 7 + 1
    assert torch.equal(alone[0, 2:], a[1, 5:])
    other = generate(model, prompts, seed=99, **kw)
    assert not torch.equal(other[:, 5:], a[:, 5:])  # the seed matters
    greedy = generate(model, prompts, max_new_tokens=NEW)
    assert torch.equal(generate(model, prompts, max_new_tokens=NEW, do_sample=True, top_k=1, seed=3), greedy)


def test_limits_and_errors():
    torch.manual_seed(0)
    model = build("gpt2")  # 64 positions
    p = torch.arange(2, 12)  # 10 tokens
    assert generate(model, p, max_new_tokens=NEW, max_out_tokens=14).shape == (1, 14)
    both = generate(model, [p[:4], p], max_new_tokens=NEW, max_out_tokens=14)
    assert both.shape == (2, 20) and torch.equal(both[1, 14:], torch.zeros(6, dtype=torch.long))
    runner = runner_for(model)  # a runner is accepted in place of the model
    assert torch.equal(generate(runner, [p[:4], p], max_new_tokens=NEW, max_out_tokens=14), both)
    assert generate(model, p, max_new_tokens=0).shape == (1, 10)
    assert generate(model, torch.arange(2, 62), max_new_tokens=NEW).shape == (1, 64)  # model's end
    with pytest.raises(ValueError, match="prompt 1 has 10 tokens, more than max_out_tokens=9"):
        generate(model, [p[:3], p], max_new_tokens=4, max_out_tokens=9)
    with pytest.raises(ValueError, match="prompt 0 has 65 tokens, more than the model's 64 positions"):
        generate(model, torch.arange(65) % 100, max_new_tokens=1)
    ids, mask = _batch(128)
    with pytest.raises(ValueError, match="row 1 has padding after or inside the prompt"):
        generate(model, ids, mask.flip(1), max_new_tokens=1)
    with pytest.raises(ValueError, match="holds single token ids"):
        generate(model, [3, 4, 5], max_new_tokens=1)
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 0"):
        generate(model, p, max_new_tokens=-1)
    with pytest.raises(ValueError, match="cache kind must be 'contiguous' or 'paged'"):
        generate(model, p, max_new_tokens=2, cache="ring")
