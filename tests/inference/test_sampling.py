"""meshspeed.inference.sampling: greedy, temperature, top-k, top-p and seeds.

Where Hugging Face has the same filter (TopKLogitsWarper, TopPLogitsWarper) its kept set
is the reference; the hand-made cases pin the boundary rules that the docstring states.
"""

import math

import pytest
import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from meshspeed.inference.sampling import SamplingParams, filter_logits, next_tokens

torch.set_num_threads(1)


def kept(logits):
    return torch.isfinite(logits)


def random_logits(n=6, vocab=50, seed=0):
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_the_argmax_and_ties_go_to_the_lowest_id():
    logits = random_logits()
    torch.testing.assert_close(next_tokens(logits, SamplingParams()), logits.argmax(-1), rtol=0, atol=0)
    # do_sample with temperature 0 is greedy too, and draws nothing from the generator.
    g = torch.Generator().manual_seed(0)
    state = g.get_state()
    picks = next_tokens(logits, SamplingParams(do_sample=True, temperature=0), g)
    assert torch.equal(picks, logits.argmax(-1)) and torch.equal(g.get_state(), state)
    tie = torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0]])
    assert next_tokens(tie, SamplingParams()).tolist() == [1]


def test_temperature_divides_the_logits():
    logits = random_logits()
    out = filter_logits(logits, SamplingParams(do_sample=True, temperature=0.5))
    torch.testing.assert_close(out, logits / 0.5, rtol=0, atol=0)


@pytest.mark.parametrize("k", [1, 3, 49, 50, 80])
def test_top_k_keeps_the_k_most_likely(k):
    logits = random_logits()
    out = filter_logits(logits, SamplingParams(do_sample=True, top_k=k))
    ref = TopKLogitsWarper(top_k=k)(None, logits.clone())
    assert torch.equal(kept(out), kept(ref))
    assert kept(out).sum(-1).tolist() == [min(k, 50)] * 6
    torch.testing.assert_close(out[kept(out)], logits[kept(out)], rtol=0, atol=0)


@pytest.mark.parametrize("k", [None, 0])
def test_top_k_none_or_zero_keeps_everything(k):
    assert kept(filter_logits(random_logits(), SamplingParams(do_sample=True, top_k=k))).all()


def test_top_p_keeps_the_smallest_set_that_reaches_p():
    # probabilities 0.05, 0.5, 0.15, 0.3 at ids 0..3: by likelihood 1, 3, 2, 0
    logits = torch.tensor([[0.05, 0.5, 0.15, 0.3]]).log()
    cases = {0.45: [1], 0.75: [1, 3], 0.85: [1, 3, 2], 0.99: [0, 1, 2, 3], 1.0: [0, 1, 2, 3]}
    for p, ids in cases.items():
        out = filter_logits(logits, SamplingParams(do_sample=True, top_p=p))
        assert kept(out)[0].nonzero().flatten().tolist() == sorted(ids), p
    # the most likely token stays even when it alone is more than p
    out = filter_logits(torch.tensor([[0.0, 9.0, 1.0]]), SamplingParams(do_sample=True, top_p=0.01))
    assert kept(out)[0].tolist() == [False, True, False]


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_top_p_matches_hugging_face(p):
    logits = random_logits(n=8, seed=3)
    out = filter_logits(logits, SamplingParams(do_sample=True, top_p=p))
    ref = TopPLogitsWarper(top_p=p)(None, logits.clone())
    assert torch.equal(kept(out), kept(ref))


def test_temperature_then_top_k_then_top_p():
    logits = random_logits(seed=5)
    params = SamplingParams(do_sample=True, temperature=0.7, top_k=10, top_p=0.8)
    ref = TopPLogitsWarper(top_p=0.8)(None, TopKLogitsWarper(top_k=10)(None, logits / 0.7))
    out = filter_logits(logits, params)
    assert torch.equal(kept(out), kept(ref))
    torch.testing.assert_close(out[kept(out)], (logits / 0.7)[kept(out)], rtol=0, atol=0)


def test_sampling_draws_from_the_filtered_distribution_with_the_given_generator():
    logits = random_logits()
    params = SamplingParams(do_sample=True, temperature=1.3, top_k=5)
    picks = next_tokens(logits, params, torch.Generator().manual_seed(11))
    probs = (filter_logits(logits, params)).softmax(-1)
    expected = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(11)).squeeze(-1)
    assert torch.equal(picks, expected)
    top5 = logits.topk(5, dim=-1).indices
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        assert (next_tokens(logits, params, g)[:, None] == top5).any(-1).all()


def test_a_seed_reproduces_its_draws_and_another_seed_does_not():
    logits = torch.zeros(1, 1000)  # uniform: two seeds agreeing 20 times is ~1e-60
    params = SamplingParams(do_sample=True, seed=123)

    def draws(params):
        g = params.generator()
        return [int(next_tokens(logits, params, g)) for _ in range(20)]

    assert draws(params) == draws(params)
    assert draws(params) != draws(SamplingParams(do_sample=True, seed=124))
    assert SamplingParams(do_sample=True).generator() is None


def test_sampled_frequencies_follow_the_temperature():
    # two tokens with logits 0 and log 3: p = 3/4 at T=1, sqrt3/(1+sqrt3) ~ 0.634 at T=2
    logits = torch.tensor([[0.0, math.log(3)]]).expand(4000, 2)
    for t, p in [(1.0, 0.75), (2.0, math.sqrt(3) / (1 + math.sqrt(3)))]:
        params = SamplingParams(do_sample=True, temperature=t)
        freq = next_tokens(logits, params, torch.Generator().manual_seed(0)).float().mean().item()
        assert abs(freq - p) < 0.03, (t, freq, p)  # 4 standard errors at n=4000


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -0.1}, "temperature must be >= 0, got -0.1"),
    ({"top_k": -1}, "top_k must be >= 0, got -1"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
])
def test_bad_parameters_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(do_sample=True, **kwargs)
