"""apply_tensor_parallel on the reference GPT: one-process reference vs tp=2 (world 2,
gloo), forward loss and every gradient in logical form, with and without sequence
parallelism; tied and untied embeddings; grouped-query attention."""

from __future__ import annotations

import pytest
import torch

from meshspeed.models.gpt import GPT, GPTConfig
from meshspeed.tensor_parallel import apply_tensor_parallel
from meshspeed.tensor_parallel.plan import PlanError
from meshspeed.testing import run_distributed
from tests.tensor_parallel.parity import check_parity, topology

CASES = {
    "untied": dict(n_head=4, n_kv_head=4, tie_embeddings=False),
    "tied_gqa": dict(n_head=4, n_kv_head=2, tie_embeddings=True),
    "odd_vocab_gqa": dict(n_head=4, n_kv_head=2, vocab_size=61),  # vocab padded to 62
}


def _gpt(**kw) -> GPT:
    torch.manual_seed(0)
    cfg = dict(vocab_size=64, max_seq_len=16, n_layer=2, d_model=32, ffn_hidden=48)
    return GPT(GPTConfig(**{**cfg, **kw}))


def _run(model):
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, model.config.vocab_size, (2, 8), generator=g)
    targets = torch.randint(0, model.config.vocab_size, (2, 8), generator=g)
    return model(idx, targets)


def _gpt_parity():
    out = {}
    for name, kw in CASES.items():
        for sp in (False, True):
            out[f"{name}/sp={sp}"] = check_parity(_gpt(**kw), _run, sequence_parallel=sp)
    return out


def _gpt_behaviour():
    mesh = topology(2)
    model = apply_tensor_parallel(_gpt(tie_embeddings=True), mesh)
    tied = model.lm_head.weight is model.tok_emb.weight
    idx = torch.zeros(1, 4, dtype=torch.long)
    logits_shape = tuple(model(idx).shape)
    try:
        apply_tensor_parallel(model, mesh)
        twice = None
    except PlanError as exc:
        twice = str(exc)
    one = _gpt()
    same = apply_tensor_parallel(one, topology(1)) is one and not hasattr(one.lm_head, "tp_shards")
    return tied, logits_shape, twice, same


def test_gpt_parity_tp2():
    for result in run_distributed(_gpt_parity, world_size=2):
        assert result == {k: [] for k in result}, result


def test_gpt_tied_logits_twice_tp1():
    tied, shape, twice, same = run_distributed(_gpt_behaviour, world_size=2)[0]
    assert tied  # one Parameter shared by the vocab embedding and the head
    assert shape == (1, 4, 32)  # this rank's half of the 64-token vocabulary
    assert twice == "GPT is already tensor-parallel (it has split parameters); " \
                    "apply_tensor_parallel runs once per model"
    assert same


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
