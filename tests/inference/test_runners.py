"""The runners against the models' own forward (fp32, rtol 1e-5 on logits: the same math
in another order, padded batches and masked SDPA instead of is_causal): prefill of
prompts of different lengths in one batch, then decode steps, with both caches; plus the
contracts other pieces rely on (layers as modules called once per step, projections
called as modules)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from meshspeed.inference.protocol import Runner
from meshspeed.inference.runners import runner_for
from tests.inference.models import FAMILIES, build, forward_logits

RTOL, ATOL = 1e-5, 1e-5  # atol: logits near zero


def _prompts(vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (n,), generator=g) for n in (7, 3, 11)]


@pytest.mark.parametrize("kind", ["paged", "contiguous"])
@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_and_decode_match_forward(family, kind):
    torch.manual_seed(0)
    model = build(family)
    runner = runner_for(model)
    assert isinstance(runner, Runner)
    prompts = _prompts(runner.vocab_size)
    cache = runner.new_cache(kind, max_batch=3, max_tokens=20, block_size=4)
    ids = [10, 11, 12]
    logits = runner.prefill(cache, ids, prompts)
    assert logits.dtype == torch.float32 and logits.shape == (3, runner.vocab_size)
    for i, p in enumerate(prompts):
        torch.testing.assert_close(logits[i], forward_logits(model, p)[-1], rtol=RTOL, atol=ATOL)
    seqs = list(prompts)
    for _ in range(5):  # sequence 0 crosses block boundaries at 8 and 12 tokens
        tokens = logits.argmax(-1)
        seqs = [torch.cat((s, t[None])) for s, t in zip(seqs, tokens)]
        logits = runner.decode(cache, ids, tokens)
        for i, s in enumerate(seqs):
            torch.testing.assert_close(logits[i], forward_logits(model, s)[-1], rtol=RTOL, atol=ATOL)
    assert [cache.length(s) for s in ids] == [12, 8, 16]


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_llama_family_layouts(family):
    torch.manual_seed(0)
    model = build(family)
    runner = runner_for(model)
    prompts = _prompts(runner.vocab_size)[:2]
    cache = runner.new_cache("paged", 2, 16, block_size=4)
    logits = runner.prefill(cache, [0, 1], prompts)
    tokens = logits.argmax(-1)
    logits = runner.decode(cache, [0, 1], tokens)
    for i, p in enumerate(prompts):
        want = forward_logits(model, torch.cat((p, tokens[i:i + 1])))[-1]
        torch.testing.assert_close(logits[i], want, rtol=RTOL, atol=ATOL)


def test_layers_are_modules_called_once_per_step():
    """ZeRO-Inference hooks runner.layers / embed / head: one forward each per step."""
    torch.manual_seed(0)
    runner = runner_for(build("llama"))
    calls = []
    for name, module in [("embed", runner.embed), ("head", runner.head),
                         *((f"layer{i}", m) for i, m in enumerate(runner.layers))]:
        module.register_forward_pre_hook(lambda mod, args, name=name: calls.append(name))
    cache = runner.new_cache("paged", 2, 16)
    runner.prefill(cache, [0, 1], [torch.tensor([1, 2, 3]), torch.tensor([4])])
    runner.decode(cache, [0, 1], torch.tensor([5, 6]))
    per_step = ["embed", "layer0", "layer1", "head"]
    assert calls == per_step * 2
    # the wrapped HF layer's parameters are the runner layer's (a hook can gather them)
    assert {id(p) for p in runner.layers[0].parameters()} >= \
        {id(p) for p in runner.layers[0].layer.self_attn.q_proj.parameters()}


class _Opaque(nn.Module):
    """A projection without a `weight` attribute (as a quantized or offloaded one may be)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


@pytest.mark.parametrize("family", FAMILIES)
def test_projections_are_called_as_modules(family):
    torch.manual_seed(0)
    model = build(family)
    p = _prompts(128)[0]
    want = forward_logits(model, p)[-1]
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D":
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, _Opaque(module))
    runner = runner_for(model)
    got = runner.prefill(runner.new_cache("paged", 1, 16), [0], [p])[0]
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)


def test_errors():
    torch.manual_seed(0)
    with pytest.raises(TypeError, match="no inference runner for Linear"):
        runner_for(nn.Linear(2, 2))
    runner = runner_for(build("gpt2"))  # 64 positions
    with pytest.raises(ValueError, match="max_tokens=65 exceeds the model's 64 positions"):
        runner.new_cache("paged", 1, 65)
    cache = runner.new_cache("paged", 2, 64)
    with pytest.raises(ValueError, match="prompt of sequence 0 has 0 tokens"):
        runner.prefill(cache, [0], [torch.tensor([], dtype=torch.long)])
    runner.prefill(cache, [0], [torch.tensor([1, 2])])
    with pytest.raises(ValueError, match="decode got 2 tokens for 1 sequences"):
        runner.decode(cache, [0], torch.tensor([1, 2]))
    with pytest.raises(KeyError, match="sequence 3 is not in the paged cache"):
        runner.decode(cache, [3], torch.tensor([1]))
