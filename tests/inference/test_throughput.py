"""meshspeed.inference.throughput: static against continuous batching (counts, not time)."""

import pytest
import torch

from meshspeed.inference.throughput import (
    compare_batching,
    continuous_batches,
    mixed_requests,
    static_batches,
)
from meshspeed.models.gpt import GPT, GPTConfig
from tests.inference._ref_runner import VOCAB, RefRunner

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, max_seq_len=48, n_layer=2, n_head=4, d_model=32)).eval()


def test_continuous_batching_takes_fewer_decode_steps_than_static(model):
    g = torch.Generator().manual_seed(0)
    news = [12, 2, 2, 2, 12, 2, 2, 2]  # each static batch waits for its one long request
    requests = [(torch.randint(0, VOCAB, (3 + s % 4,), generator=g), n) for s, n in enumerate(news)]
    result = compare_batching(RefRunner(model), requests, max_batch=4, max_tokens=32)
    static, cont = result["static"], result["continuous"]
    assert static["tokens"] == cont["tokens"] == sum(news)
    # static: two batches, each decoding 11 steps after its prefill for the 12-token request;
    # continuous: the first three short requests end at step 1, so the second long one
    # joins at step 2 and ends 11 decodes later, overlapping the first.
    assert static["decode_steps"] == 22 and static["prefill_calls"] == 2
    assert cont["decode_steps"] == 12
    assert cont["tokens_per_s"] > 0 and static["tokens_per_s"] > 0
    assert result["agreement"] == 1.0  # fp32 and a batch-blind runner: the same tokens


def test_static_batches_generate_what_the_server_generates(model):
    requests = mixed_requests(6, vocab_size=VOCAB, prompt_lengths=(2, 6), new_tokens=(1, 5), seed=1)
    out, stats = static_batches(RefRunner(model), requests, max_batch=8, max_tokens=16)
    assert stats.prefill_calls == 1 and stats.decode_steps == max(n for _, n in requests) - 1
    assert [len(t) for t in out] == [n for _, n in requests]
    cont, _ = continuous_batches(RefRunner(model), requests, max_batch=3, max_tokens=16)
    assert out == cont
    with pytest.raises(ValueError, match="max_new_tokens must be at least 1 for every request, got 0"):
        static_batches(RefRunner(model), [(torch.tensor([1]), 0)], max_batch=2, max_tokens=16)


def test_mixed_requests_are_reproducible_and_in_range():
    a = mixed_requests(20, vocab_size=50, prompt_lengths=(3, 5), new_tokens=(7, 9), seed=4)
    b = mixed_requests(20, vocab_size=50, prompt_lengths=(3, 5), new_tokens=(7, 9), seed=4)
    assert all(torch.equal(p, q) and m == n for (p, m), (q, n) in zip(a, b))
    assert {p.numel() for p, _ in a} == {3, 4, 5} and {n for _, n in a} == {7, 8, 9}
    assert all(0 <= int(p.min()) and int(p.max()) < 50 for p, _ in a)
