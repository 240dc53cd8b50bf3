import math

import pytest
import torch

from meshspeed.models import GPT, GPTConfig, param_count

torch.set_num_threads(1)

TINY = {"vocab_size": 256, "max_seq_len": 32, "n_layer": 2, "n_head": 4, "d_model": 32}


def make(**overrides) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**{**TINY, **overrides}))


def tokens(B: int = 2, T: int = 16, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (B, T), generator=g)


def test_shapes_and_initial_loss():
    model = make()
    idx = tokens()
    assert model(idx).shape == (2, 16, 256)
    loss = model(idx, targets=tokens(seed=2))
    assert loss.dim() == 0
    # small init -> near-uniform logits -> loss close to ln(vocab)
    assert abs(loss.item() - math.log(256)) < 0.1


def test_init_is_deterministic_given_seed():
    a, b = make(), make()
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(pa, pb), name


def test_config_defaults_and_validation():
    cfg = GPTConfig()
    assert cfg.kv_heads == cfg.n_head
    assert cfg.hidden_dim == 352  # 8/3 * 128 = 341.3 -> next multiple of 32
    with pytest.raises(ValueError, match="n_kv_head"):
        GPTConfig(n_head=4, n_kv_head=3)
    with pytest.raises(ValueError, match="divisible by n_head"):
        GPTConfig(d_model=130, n_head=4)


def test_grouped_query_attention():
    model = make(n_kv_head=2)
    attn = model.layers[0].attn
    assert attn.wk.weight.shape == (2 * 8, 32)  # 2 kv heads of head_dim 8
    assert model(tokens()).shape == (2, 16, 256)
    assert param_count(model) == model.config.num_params()


@pytest.mark.parametrize("tie", [False, True])
def test_param_count_matches_config(tie):
    model = make(tie_embeddings=tie)
    assert param_count(model) == model.config.num_params()


def test_tied_embeddings_share_one_parameter():
    model = make(tie_embeddings=True)
    assert model.lm_head.weight is model.tok_emb.weight
    params = list(model.parameters())
    assert sum(p is model.tok_emb.weight for p in params) == 1
    untied = make(tie_embeddings=False)
    assert param_count(untied) - param_count(model) == 256 * 32


def test_causal_future_tokens_do_not_change_past_logits():
    model = make(n_kv_head=2)
    idx = tokens(B=1, T=12)
    changed = idx.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % 256
    a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :8], b[:, :8])
    assert not torch.allclose(a[:, 8:], b[:, 8:])


def test_rotary_tables_are_not_checkpointed():
    model = make()
    assert not any(k.endswith((".cos", ".sin")) for k in model.state_dict())
    assert any(name.endswith(".cos") for name, _ in model.named_buffers())


def test_generate_length_and_sequence_limit():
    model = make()
    prompt = tokens(B=2, T=5)
    out = model.generate(prompt, max_new_tokens=7, temperature=0.8, top_k=10)
    assert out.shape == (2, 12)
    assert torch.equal(out[:, :5], prompt)
    # longer than max_seq_len: context is cropped, generation still works
    long = model.generate(tokens(B=1, T=30), max_new_tokens=5, temperature=0)
    assert long.shape == (1, 35)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(tokens(B=1, T=33))


def test_a_few_adamw_steps_reduce_loss():
    model = make()
    x = tokens(B=4, T=16)
    y = torch.roll(x, -1, dims=1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(10):
        loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5


MOE = {"n_layer": 4, "moe_num_experts": 4}


def test_moe_variant_replaces_every_other_mlp():
    model = make(**MOE)
    assert [type(b.mlp).__name__ for b in model.layers] == ["SwiGLU", "MoE", "SwiGLU", "MoE"]
    assert [type(b.mlp).__name__ for b in make(**MOE, moe_every=1).layers] == ["MoE"] * 4
    experts = model.layers[1].mlp.deepspeed_moe.experts.deepspeed_experts
    assert len(experts) == 4 and all(type(e).__name__ == "SwiGLU" for e in experts)
    assert not torch.equal(experts[0].w1.weight, experts[1].w1.weight)  # initialised one by one
    assert experts[0].w2.weight.std().item() == pytest.approx(0.02 / math.sqrt(8), rel=0.2)
    for ep in (1, 2):  # an ep rank holds moe_num_experts / ep of them
        local = make(**MOE, moe_ep_size=ep)
        assert param_count(local) == local.config.num_params()
    with pytest.raises(ValueError, match="moe_ep_size"):
        GPTConfig(moe_num_experts=3, moe_ep_size=2)


def test_moe_loss_adds_the_weighted_aux_losses():
    model = make(**MOE, moe_aux_loss_coef=0.5, moe_use_rts=False)  # deterministic routing
    x, y = tokens(), tokens(seed=2)
    loss = model(x, y)
    aux = [b.aux_loss for b in model.layers if b.aux_loss is not None]
    assert len(aux) == 2 and all(a.requires_grad for a in aux)
    ce = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
    torch.testing.assert_close(loss, ce + 0.5 * (aux[0] + aux[1]))
    loss.backward()
    assert model.layers[1].mlp.deepspeed_moe.gate.wg.weight.grad.abs().sum() > 0


def test_moe_tp_plan_splits_no_expert_and_no_router():
    from meshspeed.tensor_parallel.plan import normalize, resolve

    model = make(**MOE)
    split = {a.name for a in resolve(model, normalize(model.tp_plan))}
    assert {"layers.0.mlp.w1", "layers.2.mlp.w2", "layers.1.attn.wq", "layers.3.mlp_norm"} <= split
    assert not any("deepspeed_moe" in name for name in split)
    every = make(**MOE, moe_every=1)  # no dense MLP left: no entry may match nothing
    assert not any(".mlp.w" in name for name in {a.name for a in resolve(every, normalize(every.tp_plan))})
    assert GPT.tp_plan["layers.*.mlp.w1"] == "column" and "tp_plan" not in vars(make())
