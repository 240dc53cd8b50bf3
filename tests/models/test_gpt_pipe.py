"""The reference GPT's pipeline form computes what the GPT computes (same weights)."""

import pytest
import torch

from meshspeed.models.gpt import GPT, GPTConfig
from meshspeed.models.gpt_pipe import GPTPipe, gpt_state_to_pipe


@pytest.mark.parametrize("tie", [False, True])
def test_pipeline_form_equals_the_gpt(tie):
    cfg = GPTConfig(vocab_size=32, max_seq_len=8, n_layer=2, n_head=2, d_model=16, tie_embeddings=tie)
    torch.manual_seed(0)
    gpt = GPT(cfg)
    pipe = GPTPipe(cfg, num_stages=1)
    pipe.load_state_dict(gpt_state_to_pipe(gpt.state_dict(), cfg))
    ids = torch.randint(0, 32, (3, 8))
    torch.testing.assert_close(pipe(ids), gpt(ids))
    loss = pipe.loss_fn(pipe(ids[:, :-1]), ids[:, 1:])
    torch.testing.assert_close(loss, gpt(ids[:, :-1], ids[:, 1:]))
    assert sum(p.numel() for p in pipe.parameters()) == sum(p.numel() for p in gpt.parameters())


def test_layers_initialise_like_the_gpt():
    """N(0, 0.02), the residual projections scaled by 1/sqrt(2 n_layer), norms at 1."""
    cfg = GPTConfig(vocab_size=64, d_model=64, n_layer=8, n_head=4)
    pipe = GPTPipe(cfg, num_stages=1)
    assert pipe.get_submodule("1.attn.wq").weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert pipe.get_submodule("1.attn.wo").weight.std().item() == pytest.approx(0.02 / 4, rel=0.1)
    assert torch.all(pipe.get_submodule("9").weight == 1)


def test_the_moe_variant_has_no_pipeline_form():
    cfg = GPTConfig(vocab_size=32, max_seq_len=8, n_layer=2, n_head=2, d_model=16, moe_num_experts=2)
    with pytest.raises(ValueError, match="no MoE variant"):
        GPTPipe(cfg, num_stages=1)
