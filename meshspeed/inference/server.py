"""Continuous batching: `Server` takes requests at any time and runs them in one batch.

    server = Server(runner, max_batch=8, max_tokens=256)
    a = server.submit(prompt_a, max_new_tokens=32)
    server.step()                       # a is admitted: prefill (first token) + one decode
    b = server.submit(prompt_b, 8, do_sample=True, top_p=0.9, seed=1)
    finished = server.step()            # b joins the running batch at this step boundary
    server.run_until_done()             # a.tokens, b.tokens, a.finish_reason ...

Each `step` is one scheduling round (Orca, Yu et al., OSDI 2022, "iteration-level
scheduling"): admit waiting requests at the boundary, then one batched decode of every
running request. A request that finishes leaves the batch and frees its cache blocks in
that step, so the next step can admit a waiting request into its place; static batching
would hold the slot until the batch's longest request finished (throughput.py measures
the difference).

The server speaks only the `Runner` / `Cache` protocols (protocol.py); a plain model is
wrapped by `meshspeed.inference.runners.runner_for`. Under tensor parallelism every rank
runs the same server on the same requests in lockstep; seeded requests then draw the same
tokens on every rank (unseeded ones need the same global torch seed on every rank).
"""

from __future__ import annotations

import enum
import math
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from meshspeed.inference.protocol import Cache, Runner
from meshspeed.inference.runners import runner_for
from meshspeed.inference.sampling import SamplingParams, next_tokens


class RequestState(enum.Enum):
    WAITING = "waiting"  # submitted, not yet in the cache
    RUNNING = "running"  # prefilled, in the batch, holding cache blocks
    FINISHED = "finished"  # stop token or max_new_tokens reached; its blocks are free


@dataclass(eq=False)
class Request:
    """A handle on one submitted request; the server fills it in as it runs."""

    id: int  # also the sequence id in the cache
    prompt: torch.Tensor  # (T,) token ids
    max_new_tokens: int
    sampling: SamplingParams
    stop_token_ids: frozenset[int]
    on_token: Callable[[Request, int], None] | None = None  # called with each new token
    tokens: list[int] = field(default_factory=list)  # generated so far
    finish_reason: str | None = None  # "stop" or "length" once done
    state: RequestState = RequestState.WAITING
    # Made at the first draw, on the logits' device (a CUDA draw needs a CUDA generator).
    generator: torch.Generator | None = field(default=None, repr=False)

    @property
    def done(self) -> bool:
        return self.state is RequestState.FINISHED

    @property
    def reserve(self) -> int:
        """Tokens this request may come to need in the cache (its worst case)."""
        return self.prompt.numel() + self.max_new_tokens

    def _move(self, old: RequestState, new: RequestState) -> None:
        if self.state is not old:
            raise RuntimeError(f"request {self.id} is {self.state.value}, expected {old.value} "
                               f"before becoming {new.value}")
        self.state = new


@dataclass
class ServerStats:
    """Counters for benchmarks; tests read them too (decode steps are what batching saves)."""

    steps: int = 0  # calls of step() with anything waiting or running
    prefill_calls: int = 0  # runner.prefill calls (one per step that admitted requests)
    decode_steps: int = 0  # runner.decode calls (one per step with a running batch)
    tokens: int = 0  # tokens generated, first tokens included


def _sampling_from(sampling: SamplingParams | None, kwargs: dict) -> SamplingParams:
    if sampling is not None and kwargs:
        raise ValueError(f"pass either sampling=SamplingParams(...) or the keyword arguments "
                         f"{sorted(kwargs)}, not both")
    if sampling is not None:
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        return sampling
    return SamplingParams(**kwargs)


class Server:
    """Continuous batching over one runner and one cache (first come, first served).

    max_batch: most requests in the running batch. max_tokens: longest sequence (prompt +
    new tokens) a request may reach; None = the runner's max_positions. block_size,
    num_blocks, cache: passed to `runner.new_cache` (num_blocks None: the runner's default
    pool, enough for max_batch sequences of max_tokens).
    """

    def __init__(self, runner_or_model, *, max_batch: int = 8, max_tokens: int | None = None,
                 block_size: int = 16, num_blocks: int | None = None, cache: str = "paged"):
        if isinstance(runner_or_model, Runner):
            runner = runner_or_model
        else:
            # Lazily: the runners pull in model-specific code the server does not need.
            runner = runner_for(runner_or_model)
        if max_tokens is None:
            max_tokens = runner.max_positions
        if cache not in ("paged", "contiguous"):
            raise ValueError(f"cache={cache!r} is not a cache kind; use 'paged' or 'contiguous'")
        if max_batch < 1 or max_tokens < 1 or block_size < 1:
            raise ValueError(f"max_batch={max_batch}, max_tokens={max_tokens} and "
                             f"block_size={block_size} must all be at least 1")
        if max_tokens > runner.max_positions:
            raise ValueError(f"max_tokens={max_tokens} is more than the model's "
                             f"max_positions={runner.max_positions}; use at most that")
        self.runner = runner
        self.max_batch = max_batch
        self.max_tokens = max_tokens
        self.block_size = block_size
        self.cache: Cache = runner.new_cache(cache, max_batch=max_batch, max_tokens=max_tokens,
                                             block_size=block_size, num_blocks=num_blocks)
        # The cache is empty now, so this is the whole pool (a contiguous cache: its slots).
        self.pool_blocks = self.cache.free_blocks()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.stats = ServerStats()
        self._next_id = 0
        self._reserved_blocks = 0  # running requests' worst-case blocks (contiguous: slots)
        self._events: list[tuple[Request, int]] | None = None  # tokens made, while streaming
        self._device_seen: torch.device | None = None  # where the runner's logits live
        # submit() may be called from another thread than the one stepping; the lock guards
        # the id counter and the waiting queue (nothing else is shared with submit).
        self._lock = threading.Lock()

    # -- requests ---------------------------------------------------------------------------

    def submit(self, prompt_ids, max_new_tokens: int, *, sampling: SamplingParams | None = None,
               stop_token_ids: Iterable[int] | None = None,
               on_token: Callable[[Request, int], None] | None = None, **sampling_kwargs) -> Request:
        """Queue one request; it joins the batch at a later step boundary (FCFS).

        prompt_ids: 1-D token ids (a tensor or a list). Sampling is `sampling` or the
        keyword arguments do_sample / temperature / top_k / top_p / seed. A request whose
        prompt + max_new_tokens can never fit is rejected here, not left waiting forever.
        """
        prompt = torch.as_tensor(prompt_ids)
        if prompt.numel() and (prompt.is_floating_point() or prompt.is_complex()
                               or prompt.dtype == torch.bool):
            raise ValueError(f"prompt_ids must be integer token ids, got dtype {prompt.dtype}")
        prompt = prompt.to(dtype=torch.long)
        if prompt.dim() != 1 or prompt.numel() == 0:
            raise ValueError(f"prompt_ids must be a non-empty 1-D sequence of token ids, got shape "
                             f"{tuple(prompt.shape)}")
        vocab = self.runner.vocab_size
        bad = prompt[(prompt < 0) | (prompt >= vocab)]
        if bad.numel():
            raise ValueError(f"prompt_ids hold token {int(bad[0])}, outside the model's "
                             f"vocabulary [0, {vocab})")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        params = _sampling_from(sampling, sampling_kwargs)
        stops = frozenset(int(t) for t in (stop_token_ids or ()))
        self._check_fits(prompt, max_new_tokens)
        with self._lock:
            request = Request(self._next_id, prompt, max_new_tokens, params, stops, on_token)
            self._next_id += 1
            self.waiting.append(request)
        return request

    def _check_fits(self, prompt: torch.Tensor, max_new_tokens: int) -> None:
        need = prompt.numel() + max_new_tokens
        if need > self.max_tokens:
            raise ValueError(f"request needs {prompt.numel()} prompt + {max_new_tokens} new = "
                             f"{need} tokens, more than the server's max_tokens={self.max_tokens}")
        if self.cache.kind == "paged" and self._blocks(need) > self.pool_blocks:
            raise ValueError(f"request needs {need} tokens = {self._blocks(need)} blocks of "
                             f"{self.block_size}, more than the whole pool of {self.pool_blocks} "
                             f"blocks")

    def _blocks(self, tokens: int) -> int:
        """Pool units a sequence of `tokens` takes: blocks (paged) or one slot (contiguous)."""
        return math.ceil(tokens / self.block_size) if self.cache.kind == "paged" else 1

    def _device(self) -> torch.device:
        """Where token ids go: the runner's device if it names one, else where its logits
        came back (the protocol leaves device placement to the runner)."""
        device = getattr(self.runner, "device", None) or self._device_seen
        return torch.device(device) if device is not None else torch.device("cpu")

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    # -- scheduling -------------------------------------------------------------------------

    def step(self) -> list[Request]:
        """One scheduling round: admit (and prefill) what fits, then one batched decode of
        every running request. Returns the requests that finished in this round; their
        cache blocks are already free."""
        finished: list[Request] = []
        busy = bool(self.waiting or self.running)
        admitted = self._admit()
        if admitted:
            device = self._device()
            logits = self.runner.prefill(self.cache, [r.id for r in admitted],
                                         [r.prompt.to(device) for r in admitted])
            self.stats.prefill_calls += 1
            finished += self._emit(admitted, logits)
        if self.running:
            batch = list(self.running)
            last = torch.tensor([r.tokens[-1] for r in batch], dtype=torch.long,
                                device=self._device())
            logits = self.runner.decode(self.cache, [r.id for r in batch], last)
            self.stats.decode_steps += 1
            finished += self._emit(batch, logits)
        self.stats.steps += busy
        return finished

    def _admit(self) -> list[Request]:
        """Move waiting requests into the batch, oldest first, while the batch has room and
        the cache can hold them.

        Note [admission reserves the worst case]: a request is admitted only when its
        prompt + max_new_tokens blocks fit beside every running request's worst case, as
        well as `cache.can_admit` saying so. A running request therefore never finds the
        pool empty mid-decode, so nothing ever has to be preempted or recomputed; the cost
        is some blocks idle until their request grows into them. Strict FCFS: if the oldest
        waiting request does not fit, younger ones wait behind it (no starvation).
        """
        admitted: list[Request] = []
        with self._lock:
            while self.waiting and len(self.running) < self.max_batch:
                head = self.waiting[0]
                blocks = self._blocks(head.reserve)
                if self._reserved_blocks + blocks > self.pool_blocks:
                    break
                # can_admit sees the cache as it is before this step's prefill: it cannot
                # know of the requests admitted just above, which the reservation covers.
                if not self.cache.can_admit(head.reserve):
                    break
                self.waiting.popleft()
                head._move(RequestState.WAITING, RequestState.RUNNING)
                self._reserved_blocks += blocks
                self.running.append(head)
                admitted.append(head)
            if self.waiting and not self.running:
                # Nothing runs, so nothing will free blocks: this request would wait forever.
                head = self.waiting[0]
                raise RuntimeError(
                    f"request {head.id} ({head.reserve} tokens) cannot be admitted into an idle "
                    f"server: the cache has {self.cache.free_blocks()} of {self.pool_blocks} "
                    f"blocks free, so it holds sequences the server does not know of, or it "
                    f"refuses what fits its pool")
        return admitted

    def _emit(self, batch: list[Request], logits: torch.Tensor) -> list[Request]:
        """Pick each request's next token from its row of logits, with its own generator,
        and retire the requests that are done."""
        if logits.shape[0] != len(batch):
            raise RuntimeError(f"the runner returned {logits.shape[0]} rows of logits for "
                               f"{len(batch)} sequences")
        self._device_seen = logits.device
        picks = self._pick(batch, logits)
        finished = []
        for request, token in zip(batch, picks):
            request.tokens.append(token)
            self.stats.tokens += 1
            if self._events is not None:
                self._events.append((request, token))
            if request.on_token is not None:
                request.on_token(request, token)
            if token in request.stop_token_ids:
                self._finish(request, "stop")
                finished.append(request)
            elif len(request.tokens) >= request.max_new_tokens:
                self._finish(request, "length")
                finished.append(request)
        return finished

    @staticmethod
    def _pick(batch: list[Request], logits: torch.Tensor) -> list[int]:
        picks = [0] * len(batch)
        greedy = [i for i, r in enumerate(batch) if r.sampling.greedy]
        if greedy:  # argmax is row-wise: one call for all greedy rows
            rows = logits[greedy].argmax(dim=-1).tolist()
            for i, t in zip(greedy, rows):
                picks[i] = t
        for i, r in enumerate(batch):
            if not r.sampling.greedy:
                if r.generator is None and r.sampling.seed is not None:
                    r.generator = r.sampling.generator(logits.device)
                # One row at a time: a request's draw uses only its own generator, so its
                # tokens do not depend on its neighbours in the batch.
                picks[i] = int(next_tokens(logits[i : i + 1], r.sampling, r.generator)[0])
        return picks

    def _finish(self, request: Request, reason: str) -> None:
        request._move(RequestState.RUNNING, RequestState.FINISHED)
        request.finish_reason = reason
        self.cache.free(request.id)  # its blocks go back to the pool now, in this step
        self._reserved_blocks -= self._blocks(request.reserve)
        self.running.remove(request)

    # -- conveniences -----------------------------------------------------------------------

    def run_until_done(self) -> list[Request]:
        """Step until nothing waits or runs; the requests in the order they finished."""
        finished: list[Request] = []
        while not self.idle:
            finished += self.step()
        return finished

    def stream(self) -> Iterator[tuple[Request, int]]:
        """Step until idle, yielding (request, token) for every token in the order made.
        Requests may be submitted between yields; they join at the next step boundary."""
        if self._events is not None:
            raise RuntimeError("this server is already being streamed; use one stream() at a time")
        self._events = []
        try:
            while not self.idle:
                self.step()
                events, self._events = self._events, []
                yield from events
        finally:
            self._events = None

    def generate_all(self, prompts: Sequence, max_new_tokens: int | Sequence[int],
                     **submit_kwargs) -> list[list[int]]:
        """Submit every prompt, run to the end; each prompt's generated tokens, in order.
        max_new_tokens is one number for all or one per prompt."""
        if isinstance(max_new_tokens, int):
            max_new_tokens = [max_new_tokens] * len(prompts)
        if len(max_new_tokens) != len(prompts):
            raise ValueError(f"max_new_tokens has {len(max_new_tokens)} entries for "
                             f"{len(prompts)} prompts; give one number or one per prompt")
        requests = [self.submit(p, n, **submit_kwargs) for p, n in zip(prompts, max_new_tokens)]
        self.run_until_done()
        return [r.tokens for r in requests]

