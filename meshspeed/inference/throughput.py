"""Static against continuous batching on one stream of mixed-length requests.

    requests = mixed_requests(32, vocab_size=runner.vocab_size, seed=0)
    result = compare_batching(runner, requests, max_batch=8)
    result["continuous"]["tokens_per_s"] / result["static"]["tokens_per_s"]

Static batching takes the requests max_batch at a time and runs each batch until its
longest request ends; continuous batching (`Server`) refills a slot as soon as its request
ends. With mixed lengths the static batch spends its last steps decoding a few long
requests while the rest of its slots sit idle; that idle share is what continuous batching
wins back, and `decode_steps` counts it independently of timing noise.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from meshspeed.inference.protocol import Runner
from meshspeed.inference.server import Server, ServerStats

Requests = Sequence[tuple[torch.Tensor, int]]  # (prompt ids (T,), max_new_tokens) pairs


def mixed_requests(n: int, *, vocab_size: int, prompt_lengths: tuple[int, int] = (4, 32),
                   new_tokens: tuple[int, int] = (4, 64), seed: int = 0) -> list[tuple[torch.Tensor, int]]:
    """n requests with prompt lengths and max_new_tokens drawn uniformly from the inclusive
    ranges given; the same seed gives the same stream."""
    g = torch.Generator().manual_seed(seed)

    def draw(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    out = []
    for _ in range(n):
        prompt = torch.randint(0, vocab_size, (draw(*prompt_lengths),), generator=g)
        out.append((prompt, draw(*new_tokens)))
    return out


def static_batches(runner: Runner, requests: Requests, *, max_batch: int,
                   max_tokens: int | None = None, block_size: int = 16,
                   cache: str = "paged") -> tuple[list[list[int]], ServerStats]:
    """Greedy static batching: each request's tokens, and the counts (prefill calls, decode
    steps, tokens; `steps` unused).

    Requests are taken max_batch at a time, in order; a batch is prefilled together and
    decoded until its last member finishes, and only then does the next batch start.
    Finished members drop out of the decode calls rather than being padded along (the
    kinder form of static batching), so the comparison is about idle slots, not wasted
    arithmetic."""
    for _, n in requests:
        if n < 1:
            raise ValueError(f"max_new_tokens must be at least 1 for every request, got {n}")
    max_tokens = max_tokens or runner.max_positions
    kv = runner.new_cache(cache, max_batch=max_batch, max_tokens=max_tokens, block_size=block_size)
    device = torch.device(getattr(runner, "device", None) or "cpu")
    stats = ServerStats()
    outputs: list[list[int]] = []
    for start in range(0, len(requests), max_batch):
        group = list(requests[start : start + max_batch])
        ids = list(range(start, start + len(group)))
        want = {i: n for i, (_, n) in zip(ids, group)}
        prompts = [torch.as_tensor(p).to(device=device, dtype=torch.long) for p, _ in group]
        logits = runner.prefill(kv, ids, prompts)
        stats.prefill_calls += 1
        out = {i: [t] for i, t in zip(ids, logits.argmax(dim=-1).tolist())}
        stats.tokens += len(group)
        live = ids
        while True:
            for i in live:
                if len(out[i]) >= want[i]:
                    kv.free(i)
            live = [i for i in live if len(out[i]) < want[i]]
            if not live:
                break
            last = torch.tensor([out[i][-1] for i in live], dtype=torch.long, device=device)
            picks = runner.decode(kv, live, last).argmax(dim=-1).tolist()
            stats.decode_steps += 1
            stats.tokens += len(live)
            for i, t in zip(live, picks):
                out[i].append(t)
        outputs += [out[i] for i in ids]
    return outputs, stats


def continuous_batches(runner: Runner, requests: Requests, *, max_batch: int,
                       max_tokens: int | None = None, block_size: int = 16,
                       cache: str = "paged") -> tuple[list[list[int]], ServerStats]:
    """The same requests through `Server`, all submitted at once (greedy)."""
    server = Server(runner, max_batch=max_batch, max_tokens=max_tokens, block_size=block_size,
                    cache=cache)
    handles = [server.submit(prompt, n) for prompt, n in requests]
    server.run_until_done()
    return [h.tokens for h in handles], server.stats


def compare_batching(runner: Runner, requests: Requests, *, max_batch: int = 8,
                     max_tokens: int | None = None, block_size: int = 16,
                     cache: str = "paged") -> dict[str, dict[str, float]]:
    """Run `requests` both ways on `runner` and measure each.

    Returns {"static": m, "continuous": m, "agreement": f} where each m holds tokens,
    decode_steps, prefill_calls, seconds and tokens_per_s, and f is the share of requests
    whose greedy tokens are the same both ways (1.0 in fp32; low precision may flip a
    near-tie when the batch around a request changes). Seconds are wall clock, with CUDA
    synchronised before and after."""
    kwargs = {"max_batch": max_batch, "max_tokens": max_tokens, "block_size": block_size,
              "cache": cache}
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    measured, outputs = {}, {}
    for name, fn in (("static", static_batches), ("continuous", continuous_batches)):
        sync()
        t0 = time.perf_counter()
        outputs[name], stats = fn(runner, requests, **kwargs)
        sync()
        seconds = time.perf_counter() - t0
        measured[name] = {"tokens": stats.tokens, "decode_steps": stats.decode_steps,
                          "prefill_calls": stats.prefill_calls, "seconds": seconds,
                          "tokens_per_s": stats.tokens / max(seconds, 1e-9)}
    same = sum(a == b for a, b in zip(outputs["static"], outputs["continuous"]))
    return {**measured, "agreement": same / max(len(requests), 1)}
