"""init_compression and redundancy_clean on tiny models: the cleaned model is really smaller
(new tensors, not masks) and computes what the masked model computed."""

import json

import pytest
import torch
from torch import nn

from meshspeed.compression import compression_scheduler, init_compression, redundancy_clean
from meshspeed.compression.layers import Compressed, CompressedLinear
from tests.compression.models import config, convnet, gpt, group, mlp, technique, tokens

torch.set_num_threads(1)


def _masked_then_clean(model, cfg, x, steps=0):
    """Outputs of the compressed model (eval, after `steps` scheduler steps) and of the cleaned one."""
    init_compression(model, cfg)
    sched = compression_scheduler(model, cfg)
    for _ in range(steps):
        sched.step()
    model.eval()
    with torch.no_grad():
        masked = model(x)
    redundancy_clean(model, cfg)
    with torch.no_grad():
        cleaned = model(x)
    return masked, cleaned


def _compressed(model):
    return [n for n, m in model.named_modules() if isinstance(m, Compressed)]


def test_row_pruning_with_related_layer_cuts_rows_and_columns():
    model = mlp()
    fc1, fc2 = model[0], model[2]
    cfg = config(row_pruning=technique({"schedule_offset": 0, "method": "l1"},
                                       {"rp1": group(["^0$"], related=[["^2$"]], dense_ratio=0.25)}))
    keep = fc1.weight.detach().abs().sum(1).topk(4).indices.sort().values
    w1, b1, w2 = fc1.weight.detach()[keep], fc1.bias.detach()[keep], fc2.weight.detach()[:, keep]
    masked, cleaned = _masked_then_clean(model, cfg, torch.randn(5, 8))
    assert torch.allclose(masked, cleaned, atol=1e-6, rtol=0)
    assert type(model[0]) is nn.Linear and type(model[2]) is nn.Linear  # plain layers again
    assert (model[0].out_features, model[2].in_features) == (4, 4)
    assert torch.equal(model[0].weight, w1) and torch.equal(model[0].bias, b1)
    assert torch.equal(model[2].weight, w2)


def test_without_related_layers_pruned_units_become_zeros_in_place():
    model = mlp()
    cfg = config(row_pruning=technique({"schedule_offset": 0},
                                       {"rp1": group(["^0$"], dense_ratio=0.5)}))
    weight = model[0].weight
    masked, cleaned = _masked_then_clean(model, cfg, torch.randn(5, 8))
    assert torch.equal(masked, cleaned)
    assert model[0].weight is weight and weight.shape == (16, 8)  # same tensor, 8 zero rows
    assert int((weight.abs().sum(1) == 0).sum()) == 8


@pytest.mark.parametrize("method", ["topk", "l1"])
def test_head_pruning_removes_heads_from_qkv_and_output(method):
    model = gpt()
    cfg = config(head_pruning=technique(
        {"schedule_offset": 0, "method": method, "num_heads": 4},
        {"hp1": group([r"attn\.wo"], related=[[r"attn\.wq", r"attn\.wk", r"attn\.wv"]],
                      dense_ratio=0.5)}))
    masked, cleaned = _masked_then_clean(model, cfg, tokens())
    assert torch.allclose(masked, cleaned, atol=1e-6, rtol=0)
    for block in model.layers:  # 2 of 4 heads of 8 dims left
        attn = block.attn
        assert attn.wo.weight.shape == (32, 16)
        assert attn.wq.weight.shape == attn.wk.weight.shape == attn.wv.weight.shape == (16, 32)
    assert not _compressed(model)
    before = gpt()
    assert sum(p.numel() for p in model.parameters()) == (
        sum(p.numel() for p in before.parameters()) - 2 * 4 * 16 * 32)


def test_channel_pruning_with_related_conv_and_batchnorm():
    model = convnet()
    cfg = config(channel_pruning=technique(
        {"schedule_offset": 0, "method": "topk"},
        {"cp1": group(["^0$"], related=[["^3$"]], dense_ratio=0.5)}))
    masked, cleaned = _masked_then_clean(model, cfg, torch.randn(2, 3, 6, 6))
    assert torch.allclose(masked, cleaned, atol=1e-6, rtol=0)
    assert model[0].weight.shape == (4, 3, 3, 3) and model[0].bias.shape == (4,)
    assert model[3].weight.shape == (6, 4, 3, 3) and model[3].in_channels == 4
    with_bn = convnet(bn=True)
    cfg_bn = config(channel_pruning=technique(
        {"schedule_offset": 0}, {"cp1": group(["^0$"], related=[["^3$", "^1$"]], dense_ratio=0.5)}))
    init_compression(with_bn, cfg_bn)
    redundancy_clean(with_bn, cfg_bn)
    bn = with_bn[1]
    assert bn.num_features == 4 and bn.weight.shape == bn.running_mean.shape == (4,)
    assert with_bn(torch.randn(2, 3, 6, 6)).shape == (2, 6, 6, 6)


def test_sparse_pruning_and_weight_quantization_are_written_into_the_weights(tmp_path):
    model = mlp()
    cfg = config(
        weight_quantization=technique(
            {"schedule_offset": 0, "quantize_groups": 4, "quantization_type": "asymmetric",
             "quantize_weight_in_forward": True},
            {"wq1": group(["0", "2"], start_bits=8, target_bits=4)}),
        sparse_pruning=technique({"schedule_offset": 0, "method": "l1"},
                                 {"sp1": group(["^2$"], dense_ratio=0.5)}),
        activation_quantization=technique({"schedule_offset": 0},
                                          {"aq1": group(["^2$"], bits=8)}))
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"train_batch_size": 8, **cfg}))  # a whole DeepSpeed config file
    masked, cleaned = _masked_then_clean(model, str(path), torch.randn(5, 8))
    assert torch.allclose(masked, cleaned, atol=1e-6, rtol=0)
    assert type(model[0]) is nn.Linear  # nothing left to do at run time
    assert isinstance(model[2], CompressedLinear)  # activation quantization stays
    assert len(model[0].weight.unique()) <= 4 * 16  # 4 groups of 16 levels
    assert int((model[2].weight == 0).sum()) >= 32  # half of 64 weights


def test_training_keeps_working_and_an_earlier_optimizer_still_updates():
    model = gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # built before the wrapping
    cfg = config(weight_quantization=technique(
        {"schedule_offset": 0, "quantize_weight_in_forward": True},
        {"wq1": group([r"mlp\.w"], start_bits=8, target_bits=8)}))
    init_compression(model, cfg)
    before = model.layers[0].mlp.w1.weight.detach().clone()
    idx = tokens()
    model(idx[:, :-1], idx[:, 1:]).backward()
    opt.step()
    after = model.layers[0].mlp.w1.weight
    assert not torch.equal(before, after)  # stored in full precision, moved by the optimizer
    assert len(after.unique()) > 256


class _Conv1D(nn.Module):  # Hugging Face GPT-2's layout: weight (in, out)
    def __init__(self, nx, nf):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(nx, nf))
        self.bias = nn.Parameter(torch.randn(nf))

    def forward(self, x):
        return x @ self.weight + self.bias


def test_convert_conv1d_to_linear_computes_the_same():
    from meshspeed.compression import convert_conv1d_to_linear

    torch.manual_seed(0)
    model = nn.Sequential(_Conv1D(8, 12), nn.ReLU())
    x = torch.randn(3, 8)
    before = model(x)
    convert_conv1d_to_linear(model, _Conv1D)
    assert type(model[0]) is nn.Linear and model[0].weight.shape == (12, 8)
    assert torch.allclose(model(x), before, atol=1e-6)


def test_techniques_together_on_gpt_clean_to_the_same_logits():
    model = gpt()
    cfg = config(
        weight_quantization=technique(
            {"schedule_offset": 1, "quantize_groups": 8, "fp16_mixed_quantize":
             {"enabled": True, "quantize_change_ratio": 0.1}},
            {"wq1": group([r"attn\.w"], start_bits=8, target_bits=6, quantization_period=2),
             "wq2": group(["tok_emb"], start_bits=8, target_bits=8)}),
        sparse_pruning=technique({"schedule_offset": 2, "method": "topk"},
                                 {"sp1": group([r"mlp\.w2"], dense_ratio=0.3)}),
        head_pruning=technique(
            {"schedule_offset": 3, "num_heads": 4},
            {"hp1": group([r"attn\.wo"], related=[[r"attn\.wq", r"attn\.wk", r"attn\.wv"]],
                          dense_ratio=0.75)}))
    masked, cleaned = _masked_then_clean(model, cfg, tokens(), steps=5)  # 6 bits, 90% real
    assert torch.allclose(masked, cleaned, atol=1e-6, rtol=0)
    assert not _compressed(model)
    assert model.layers[1].attn.wq.weight.shape == (24, 32)  # 3 of 4 heads
    assert model.layers[1].attn.wo.weight.shape == (32, 24)
