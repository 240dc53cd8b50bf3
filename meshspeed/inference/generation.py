"""`generate`: batched generation over a KV cache, with Hugging Face `generate`'s shapes.

    out = generate(model, input_ids, attention_mask, max_new_tokens=32)  # (B, T + new)

The prompts are taken out of their padding and prefilled as one batch, then all running
sequences decode together, one token per step. A sequence stops at a stop token (kept in
the output), at `max_new_tokens`, at `max_out_tokens` (prompt + new) or at the model's
last position; its cache space is freed at once and its row is padded with
`pad_token_id` from then on. Generation ends when every sequence has stopped, so the
result may be shorter than T + max_new_tokens, as with Hugging Face.

Sampling draws from one `torch.Generator` per sequence, seeded with `seed + i` for row i,
so a row's tokens depend on its prompt and seed only, not on the rest of the batch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

from meshspeed.inference.runners import runner_for
from meshspeed.inference.sampling import SamplingParams, next_tokens


def _ids(value: int | Iterable[int] | None) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, torch.Tensor):
        return [int(v) for v in value.flatten().tolist()]
    return [int(v) for v in value]


def split_prompts(input_ids, attention_mask=None) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """(list of 1-D prompts without padding, the (B, T) input to put in front of the output
    or None when the caller gave a list and the front must be built)."""
    if isinstance(input_ids, (list, tuple)):
        if attention_mask is not None:
            raise ValueError("attention_mask goes with a (B, T) input_ids tensor, not with a list of "
                             "prompts (each prompt is all real tokens)")
        if any(isinstance(p, int) or (isinstance(p, torch.Tensor) and p.dim() == 0) for p in input_ids):
            raise ValueError("a list input_ids holds one 1-D prompt per sequence, but it holds single "
                             "token ids; pass one prompt as a 1-D tensor or wrap it in a list")
        prompts = [torch.as_tensor(p, dtype=torch.long).flatten() for p in input_ids]
        if not prompts:
            raise ValueError("generate got an empty list of prompts")
        return prompts, None
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    if ids.dim() == 1:
        ids = ids[None]
        if attention_mask is not None:
            attention_mask = torch.as_tensor(attention_mask).reshape(1, -1)
    if ids.dim() != 2:
        raise ValueError(f"input_ids must be (B, T), one 1-D prompt or a list of 1-D prompts, got "
                         f"shape {tuple(ids.shape)}")
    if attention_mask is None:
        return list(ids), ids
    mask = torch.as_tensor(attention_mask).to(ids.device).bool()
    if mask.shape != ids.shape:
        raise ValueError(f"attention_mask has shape {tuple(mask.shape)}, input_ids {tuple(ids.shape)}; "
                         f"they must match")
    prompts = []
    for i, (row, keep) in enumerate(zip(ids, mask)):
        n = int(keep.sum())
        if n == 0:
            raise ValueError(f"prompt {i} is all padding (its attention_mask row has no ones)")
        if not bool(keep[-n:].all()):
            raise ValueError(f"attention_mask row {i} has padding after or inside the prompt; "
                             f"generate expects left padding (zeros before the prompt only)")
        prompts.append(row[-n:])
    return prompts, ids


def _front(prompts: list[torch.Tensor], given: torch.Tensor | None, pad: int) -> torch.Tensor:
    if given is not None:
        return given
    T = max(p.numel() for p in prompts)
    front = torch.full((len(prompts), T), pad, dtype=torch.long, device=prompts[0].device)
    for i, p in enumerate(prompts):
        front[i, T - p.numel():] = p
    return front


def _budgets(prompts: Sequence[torch.Tensor], max_new_tokens: int, max_out_tokens: int | None,
             max_positions: int) -> list[int]:
    """Tokens (prompt + new) each sequence may reach."""
    out = []
    for i, p in enumerate(prompts):
        n = p.numel()
        if n == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        if max_out_tokens is not None and n > max_out_tokens:
            raise ValueError(f"prompt {i} has {n} tokens, more than max_out_tokens={max_out_tokens}")
        if n > max_positions:
            raise ValueError(f"prompt {i} has {n} tokens, more than the model's {max_positions} "
                             f"positions")
        limit = min(max_positions, max_out_tokens if max_out_tokens is not None else math.inf)
        out.append(int(min(n + max_new_tokens, limit)))
    return out


class _Picker:
    """Next tokens of the running rows: batched for greedy or unseeded sampling, one
    generator per row for seeded sampling."""

    def __init__(self, params: SamplingParams, rows: int, device) -> None:
        self.params = params
        self.generators = None
        if not params.greedy and params.seed is not None:
            self.generators = [torch.Generator(device=device).manual_seed(params.seed + i)
                               for i in range(rows)]

    def __call__(self, logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        if self.generators is None:
            return next_tokens(logits, self.params)
        return torch.cat([next_tokens(logits[j:j + 1], self.params, self.generators[r])
                          for j, r in enumerate(rows)])


@torch.no_grad()
def generate(model_or_runner, input_ids, attention_mask=None, *, max_new_tokens: int,
             do_sample: bool = False, temperature: float = 1.0, top_k: int | None = None,
             top_p: float | None = None, seed: int | None = None,
             stop_token_ids: int | Iterable[int] | None = None,
             eos_token_id: int | Iterable[int] | None = None, pad_token_id: int | None = None,
             cache: str = "paged", block_size: int = 16,
             max_out_tokens: int | None = None) -> torch.LongTensor:
    """The prompts followed by their generated tokens, (B, T + new), on input_ids' device.

    input_ids: (B, T), left-padded where `attention_mask` has zeros; a 1-D tensor for one
    prompt (the result is still (1, T + new)); or a list of 1-D prompts of different
    lengths (the result's front is then left-padded with the pad token).
    stop_token_ids / eos_token_id: a sequence that emits one stops (the token is kept).
    pad_token_id: fills a stopped row and a list input's padding; default the first stop
    token, else 0. cache: "paged" or "contiguous" (sized for this batch). max_out_tokens:
    the most tokens (prompt + new) a sequence may reach.
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    runner = runner_for(model_or_runner)
    params = SamplingParams(do_sample, temperature, top_k, top_p, seed)
    prompts, given = split_prompts(input_ids, attention_mask)
    stops = _ids(stop_token_ids) + _ids(eos_token_id)
    pad = pad_token_id if pad_token_id is not None else (stops[0] if stops else 0)
    front = _front(prompts, given, pad)
    budgets = _budgets(prompts, max_new_tokens, max_out_tokens, runner.max_positions)
    lengths = [p.numel() for p in prompts]
    steps = max(b - n for b, n in zip(budgets, lengths))
    if steps == 0:
        return front
    B, device = len(prompts), runner.device
    num_blocks = sum(math.ceil(b / block_size) for b in budgets)
    kv = runner.new_cache(cache, B, max(budgets), block_size, num_blocks)
    out = torch.full((B, steps), pad, dtype=torch.long, device=device)
    stop_t = torch.tensor(stops, dtype=torch.long, device=device)[None, :]  # (1, stops)
    left = [b - n for b, n in zip(budgets, lengths)]  # new tokens each row may still take
    pick = _Picker(params, B, device)

    # Per step: one batched decode and a handful of tensor ops, whatever B and the depth;
    # Python work per row only when some row stops.
    rows = list(range(B))
    logits = runner.prefill(kv, rows, [p.to(device) for p in prompts])
    done_steps = 0
    for s in range(steps):
        tokens = pick(logits, rows)  # (len(rows),)
        if len(rows) == B:
            out[:, s] = tokens
        else:
            out[torch.tensor(rows, device=device), s] = tokens
        done_steps = s + 1
        stopped = (tokens[:, None] == stop_t).any(1).tolist() if stops else [False] * len(rows)
        finished = [stop or left[r] <= s + 1 for r, stop in zip(rows, stopped)]
        if any(finished):
            for r, f in zip(rows, finished):
                if f:
                    kv.free(r)  # its blocks are free at once
            keep = [j for j, f in enumerate(finished) if not f]
            rows, tokens = [rows[j] for j in keep], tokens[keep]
            if not rows:
                break
        logits = runner.decode(kv, rows, tokens)
    return torch.cat((front, out[:, :done_steps].to(front.device)), dim=1)
