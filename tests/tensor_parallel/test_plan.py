"""Plan validation: every problem is found before anything is split, one sentence each
naming the module and the numbers. No processes: a stand-in mesh says tp=2 (or 4)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from meshspeed.config.errors import ConfigError
from meshspeed.models.gpt import GPT, GPTConfig
from meshspeed.tensor_parallel import apply_tensor_parallel, plan_from_deepspeed
from meshspeed.tensor_parallel.plan import PlanError


class _Mesh:  # the three Topology methods apply_tensor_parallel reads
    def __init__(self, tp: int):
        self.tp = tp

    def group(self, axis):
        return None

    def size(self, axis):
        return self.tp

    def coord(self, axis):
        return 0


def _gpt(**kw) -> GPT:
    cfg = dict(vocab_size=64, max_seq_len=16, n_layer=1, d_model=32, ffn_hidden=48)
    return GPT(GPTConfig(**{**cfg, **kw}))


def _errors(model, plan=None, tp=2) -> list[str]:
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(PlanError) as info:
        apply_tensor_parallel(model, _Mesh(tp), plan)
    after = dict(model.named_parameters())
    assert before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)
    assert isinstance(info.value, ConfigError) and isinstance(info.value, ValueError)
    return info.value.problems


def test_pattern_matching_nothing():
    plan = {**GPT.tp_plan, "layers.*.attn.wqkv": "column"}
    assert _errors(_gpt(), plan) == [
        "plan pattern 'layers.*.attn.wqkv' (column) matches no module of GPT"]


def test_heads_and_kv_heads_not_divisible():
    # 4 query heads, 1 kv head over tp=4 ... and 2 kv heads over tp=4
    problems = _errors(_gpt(n_head=4, n_kv_head=2), tp=4)
    assert problems == ["layers.0.attn.wk: 2 heads (of head_dim 8) do not divide over tp=4",
                        "layers.0.attn.wv: 2 heads (of head_dim 8) do not divide over tp=4"]
    assert _errors(_gpt(n_head=2, n_kv_head=1), tp=4)[0] == \
        "layers.0.attn.wq: 2 heads (of head_dim 16) do not divide over tp=4"


def test_wrong_module_types():
    plan = {"layers.0.attn_norm": "column", "layers.0.mlp.w2": "vocab",
            "norm": "vocab_head", "tok_emb": "row", "layers.0.attn.wq": "sequence_norm"}
    assert _errors(_gpt(), plan) == [
        "tok_emb: a row split needs an nn.Linear or HF Conv1D, got Embedding",
        "layers.0.attn_norm: a column split needs an nn.Linear or HF Conv1D, got RMSNorm",
        "layers.0.attn.wq: sequence_norm is for norm layers, got Linear",
        "layers.0.mlp.w2: a vocab split needs an nn.Embedding, got Linear",
        "norm: a vocab_head split needs an nn.Linear, got RMSNorm"]


def test_fused_parts_and_uneven_sizes():
    model = _gpt(ffn_hidden=51)
    plan = {"layers.0.mlp.w1": "column", "layers.0.attn.wq": {"kind": "column", "parts": [16, 8]},
            "layers.0.attn.wk": {"kind": "column", "parts": [9, 23]}}
    assert _errors(model, plan) == [
        "layers.0.attn.wq: fused parts [16, 8] add up to 24, not its 32 outputs",
        "layers.0.attn.wk: 9 outputs do not split evenly over tp=2",
        "layers.0.mlp.w1: 51 outputs do not split evenly over tp=2"]


def test_tied_head_without_vocab_embedding():
    plan = {k: v for k, v in GPT.tp_plan.items() if k != "tok_emb"}
    assert _errors(_gpt(tie_embeddings=True), plan) == [
        "lm_head: its weight is tied to tok_emb.weight, which the plan splits as nothing "
        "rather than vocab (split both as vocab/vocab_head, or neither)"]


def test_no_plan_names_the_class():
    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

    assert _errors(Tiny()) == [
        "no tensor-parallel plan for Tiny: pass plan={module glob: 'column' | 'row' | "
        "'vocab' | ...} to apply_tensor_parallel, give the model a `tp_plan` attribute, or "
        "set tensor_parallel.partition_config.layer_specs in the config"]


def test_unknown_kind_and_deepspeed_spec_errors():
    assert _errors(_gpt(), {"lm_head": "colwise"}) == [
        "plan['lm_head']: kind 'colwise' is not one of ['column', 'row', 'vocab', "
        "'vocab_head', 'sequence_norm', 'loss', 'replicate']"]
    with pytest.raises(PlanError) as info:
        plan_from_deepspeed({"layer_specs": [{"patterns": [r".*\.o_proj\.weight$"],
                                              "partition_type": "row"}]}, _gpt())
    assert info.value.problems == [
        "tensor_parallel.partition_config.layer_specs[0]: patterns ['.*\\\\.o_proj\\\\.weight$'] "
        "match no parameter of GPT"]


def test_tp1_returns_model_untouched():
    model = _gpt()
    assert apply_tensor_parallel(model, _Mesh(1), {"nothing": "column"}) is model
