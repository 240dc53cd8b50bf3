"""meshspeed.inference.Server: continuous batching against a reference runner.

The reference runner (_ref_runner.py) computes each sequence alone, so its logits cannot
depend on the batch, and its cache counts blocks like a paged pool, so admission and
freeing are observable. Any difference between the server's output and the request run
alone through the model's own generate is then the server's.
"""

import threading
import time

import pytest
import torch

from meshspeed.inference.protocol import Cache, Runner
from meshspeed.inference.sampling import SamplingParams
from meshspeed.inference.server import RequestState, Server
from meshspeed.models.gpt import GPT, GPTConfig
from tests.inference._ref_runner import VOCAB, RefRunner

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=VOCAB, max_seq_len=48, n_layer=2, n_head=4, d_model=32)
    return GPT(cfg).eval()


def prompt(n, seed):
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def alone(model, p, n):
    """Greedy tokens of one prompt from the model's own cache-less generate."""
    return model.generate(p[None], n, temperature=0)[0, p.numel():].tolist()


def test_the_reference_runner_follows_the_protocols(model):
    runner = RefRunner(model)
    assert isinstance(runner, Runner)
    assert isinstance(runner.new_cache("paged", 2, 16), Cache)


@pytest.mark.parametrize("cache", ["paged", "contiguous"])
def test_each_greedy_output_equals_the_request_run_alone(model, cache):
    lengths, news = [3, 9, 5, 12, 1, 7], [6, 2, 9, 4, 7, 1]
    prompts = [prompt(n, s) for s, n in enumerate(lengths)]
    server = Server(RefRunner(model), max_batch=3, max_tokens=32, block_size=4, cache=cache)
    reqs = [server.submit(p, n) for p, n in zip(prompts, news)]
    server.run_until_done()
    for r, p, n in zip(reqs, prompts, news):
        assert r.done and r.finish_reason == "length" and r.state is RequestState.FINISHED
        assert r.tokens == alone(model, p, n)
    assert server.idle and server.cache.free_blocks() == server.pool_blocks


def test_stop_tokens_end_a_request_with_the_stop_token_included(model):
    p = prompt(6, 1)
    ref = alone(model, p, 12)
    stop = ref[3]
    expected = ref[: ref.index(stop) + 1]
    server = Server(RefRunner(model), max_batch=2, max_tokens=32)
    r = server.submit(p, 12, stop_token_ids=[stop])
    other = server.submit(prompt(4, 2), 12)  # keeps running after r stops
    server.run_until_done()
    assert r.tokens == expected and r.finish_reason == "stop"
    assert other.tokens == alone(model, prompt(4, 2), 12)


def test_a_request_submitted_while_others_run_joins_at_the_next_step(model):
    runner = RefRunner(model)
    server = Server(runner, max_batch=4, max_tokens=32)
    a = server.submit(prompt(5, 1), 8)
    late = []

    def submit_mid_step(request, token):  # a submission in the middle of a step
        if not late:
            late.append(server.submit(prompt(3, 3), 4))

    server.step()
    assert runner.calls == [("prefill", [a.id]), ("decode", [a.id])]
    b = server.submit(prompt(7, 2), 5, on_token=submit_mid_step)
    assert b.state is RequestState.WAITING
    server.step()
    # b is prefilled at the boundary, then decoded with a in the same batch; the request
    # submitted from b's callback during this step waits for the next boundary.
    assert runner.calls[2:] == [("prefill", [b.id]), ("decode", [a.id, b.id])]
    (c,) = late
    assert c.state is RequestState.WAITING and len(a.tokens) == 3 and len(b.tokens) == 2
    server.step()
    assert runner.calls[4:] == [("prefill", [c.id]), ("decode", [a.id, b.id, c.id])]
    server.run_until_done()
    assert a.tokens == alone(model, prompt(5, 1), 8)
    assert b.tokens == alone(model, prompt(7, 2), 5)
    assert c.tokens == alone(model, prompt(3, 3), 4)


def test_a_finished_request_frees_its_blocks_in_the_same_step(model):
    server = Server(RefRunner(model), max_batch=4, max_tokens=32, block_size=4)
    total = server.pool_blocks
    short = server.submit(prompt(6, 1), 2)  # prefill token + one decode token: done in step 1
    long = server.submit(prompt(9, 2), 10)
    finished = server.step()
    assert finished == [short] and short.done and short.finish_reason == "length"
    assert short.id not in server.cache.seqs
    # long holds 9 prompt + 1 decoded token = 10 tokens = 3 blocks of 4; nothing else.
    assert server.cache.free_blocks() == total - 3
    assert server.running == [long]


def test_admission_waits_for_blocks_then_proceeds_first_come_first_served(model):
    runner = RefRunner(model)
    server = Server(runner, max_batch=8, max_tokens=16, block_size=4, num_blocks=4)
    a = server.submit(prompt(6, 1), 5)  # 11 tokens: 3 blocks
    b = server.submit(prompt(4, 2), 4)  # 8 tokens: 2 blocks, 3 + 2 > 4: must wait for a
    c = server.submit(prompt(1, 3), 3)  # 1 block would fit beside a, but b is ahead of it
    steps = 0
    while not a.done:
        server.step()
        steps += 1
        if not a.done:
            assert b.state is RequestState.WAITING and c.state is RequestState.WAITING
    assert steps == 4  # prefill + decode, then 3 more decodes reach 5 tokens
    assert server.cache.free_blocks() == 4  # a's blocks are back
    server.step()
    assert b.state is RequestState.RUNNING and c.state is RequestState.RUNNING  # 2 + 1 <= 4
    assert runner.calls[-2] == ("prefill", [b.id, c.id])
    server.run_until_done()
    assert b.tokens == alone(model, prompt(4, 2), 4) and c.tokens == alone(model, prompt(1, 3), 3)


def test_a_request_that_an_idle_server_cannot_admit_is_an_error_not_a_hang(model):
    server = Server(RefRunner(model), max_batch=2, max_tokens=16, block_size=4, num_blocks=4)
    server.cache.append(99, [1] * 13)  # a sequence the server never admitted: 4 blocks
    server.submit(prompt(3, 1), 2)
    with pytest.raises(RuntimeError, match=r"request 0 \(5 tokens\) cannot be admitted into an idle server: the cache has 0 of 4 blocks free"):
        server.step()


def test_the_batch_never_exceeds_max_batch(model):
    runner = RefRunner(model)
    server = Server(runner, max_batch=2, max_tokens=32)
    for s in range(5):
        server.submit(prompt(3, s), 3)
    sizes = []
    while not server.idle:
        server.step()
        sizes.append(len(server.running))
    assert max(sizes) == 2
    assert max(len(ids) for kind, ids in runner.calls if kind == "decode") == 2


def test_requests_that_can_never_fit_are_rejected_with_the_numbers(model):
    server = Server(RefRunner(model), max_batch=2, max_tokens=20, block_size=4, num_blocks=3)
    with pytest.raises(ValueError, match=r"6 prompt \+ 15 new = 21 tokens, more than the server's max_tokens=20"):
        server.submit(prompt(6, 1), 15)
    with pytest.raises(ValueError, match=r"needs 14 tokens = 4 blocks of 4, more than the whole pool of 3"):
        server.submit(prompt(6, 1), 8)
    with pytest.raises(ValueError, match="non-empty 1-D"):
        server.submit([], 4)
    with pytest.raises(ValueError, match="prompt_ids must be integer token ids, got dtype torch.float32"):
        server.submit(torch.tensor([1.0, 2.5]), 4)
    with pytest.raises(ValueError, match="max_new_tokens must be at least 1, got 0"):
        server.submit(prompt(3, 1), 0)
    with pytest.raises(ValueError, match=r"token 64, outside the model's vocabulary \[0, 64\)"):
        server.submit([1, 64, 2], 2)
    with pytest.raises(ValueError, match="either sampling=SamplingParams"):
        server.submit(prompt(3, 1), 2, sampling=SamplingParams(), top_k=3)
    with pytest.raises(ValueError, match="top_p must be in"):
        server.submit(prompt(3, 1), 2, do_sample=True, top_p=0)
    assert not server.waiting  # nothing rejected was queued
    server.submit(prompt(6, 1), 6)  # 12 tokens = 3 blocks: the whole pool, accepted
    with pytest.raises(ValueError, match="max_tokens=99 is more than the model's max_positions=48"):
        Server(RefRunner(model), max_tokens=99)
    with pytest.raises(ValueError, match="must all be at least 1"):
        Server(RefRunner(model), max_batch=0)
    with pytest.raises(ValueError, match="cache='pagd' is not a cache kind; use 'paged' or 'contiguous'"):
        Server(RefRunner(model), cache="pagd")


def test_requests_may_be_submitted_from_another_thread_while_the_server_steps(model):
    server = Server(RefRunner(model), max_batch=4, max_tokens=32)
    prompts = [prompt(2 + s % 3, s) for s in range(6)]
    reqs = []

    def client():
        for p in prompts:
            reqs.append(server.submit(p, 3))
            time.sleep(0.005)

    thread = threading.Thread(target=client)
    thread.start()
    while thread.is_alive() or not server.idle:
        server.step()
    thread.join()
    assert sorted(r.id for r in reqs) == list(range(6))
    assert [r.tokens for r in reqs] == [alone(model, p, 3) for p in prompts]


def sampled(model, neighbours, **params):
    """Tokens of one seeded sampled request, sharing the batch with `neighbours` (count)."""
    server = Server(RefRunner(model), max_batch=8, max_tokens=32)
    for s in range(neighbours):  # ahead of it in the queue, and sampling too
        server.submit(prompt(2 + s, 10 + s), 3 + 2 * s, do_sample=True, seed=100 + s)
    target = server.submit(prompt(5, 1), 10, **params)
    server.run_until_done()
    return target.tokens


def test_seeded_sampling_does_not_depend_on_the_batch(model):
    params = {"do_sample": True, "temperature": 1.5, "top_k": 40, "seed": 7}
    solo = sampled(model, 0, **params)
    assert sampled(model, 3, **params) == solo
    assert sampled(model, 5, sampling=SamplingParams(**params)) == solo
    # The test can see a difference: another seed draws other tokens.
    assert sampled(model, 0, **{**params, "seed": 8}) != solo


def test_stream_and_callbacks_see_every_token_in_order(model):
    server = Server(RefRunner(model), max_batch=2, max_tokens=32)
    seen = []
    reqs = [server.submit(prompt(3 + s, s), 4 + s, on_token=lambda r, t: seen.append((r.id, t)))
            for s in range(3)]
    streamed = [(r.id, t) for r, t in server.stream()]
    assert streamed == seen
    for r in reqs:
        assert [t for i, t in streamed if i == r.id] == r.tokens == alone(model, r.prompt, r.max_new_tokens)


def test_generate_all_returns_each_prompts_tokens_in_order(model):
    prompts = [prompt(n, s) for s, n in enumerate([4, 8, 2])]
    server = Server(RefRunner(model), max_batch=2, max_tokens=32)
    out = server.generate_all(prompts, [5, 2, 6])
    assert out == [alone(model, p, n) for p, n in zip(prompts, [5, 2, 6])]
    with pytest.raises(ValueError, match="max_new_tokens has 2 entries for 3 prompts"):
        server.generate_all(prompts, [1, 2])


def test_a_model_is_wrapped_by_runner_for(model):
    server = Server(model, max_batch=2, max_tokens=32, block_size=4)
    prompts = [prompt(5, 1), prompt(9, 2), prompt(3, 3)]
    assert server.generate_all(prompts, 6) == [alone(model, p, 6) for p in prompts]
