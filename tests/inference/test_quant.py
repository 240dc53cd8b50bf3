"""Weight-only INT8/INT4 quantization (meshspeed.inference.quant) on tiny randomly
initialised Hugging Face GPT-2 and Llama models (fp32, built from configs, no downloads).

What is checked and against what:
  * packing and the quantizer on tensors: INT4 pack/unpack round trip; weights already on
    the grid come back bit-exact; every element of every quantized layer is within half a
    quantization step of the original (exact bound up to fp32 rounding of w/s and q*s,
    each 2^-24 relative to |w| <= qmax*s, so a slack of 2e-5 steps);
  * the module: forward equals F.linear with the dequantized weight, any leading dims,
    chunked and plain paths, bf16 input;
  * memory: weight_bytes equals Note [quantized weight bytes]'s formula written out here
    independently, and its ratio to the fp32 weights' bytes;
  * the model: logits' relative error (||dl|| / ||l||) within a bound derived in
    _LOGIT_TOL's comment, and INT4's error about 127/7 times INT8's, as the step sizes are;
    greedy agreement of HF generate over 64 tokens, measured and printed (random-weight
    tiny models have flat logits, so agreement after the first divergence is chaos: only
    INT8's is asserted, loosely);
  * tensor parallelism (world 2, gloo): the split model quantized group-wise gives the
    logits of the whole model quantized the same way, and the ranks' weight bytes sum to
    the whole model's.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from tests.inference.models import one_thread  # noqa: F401 - the fixture, by name

transformers = pytest.importorskip("transformers")

from meshspeed.inference.quant import (
    QuantizedLinear,
    QuantizedParallelLinear,
    dequantize,
    pack_int4,
    quantize_tensor,
    quantize_weights,
    unpack_int4,
    weight_bytes,
)
from meshspeed.testing import run_distributed

VOCAB, PROMPT, NEW = 128, 8, 64
SCHEMES = [(8, None), (8, 32), (4, 32), (4, None)]
QMAX = {8: 127, 4: 7}


def gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=128,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg).float().eval()


def llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                   max_position_embeddings=128)
    return transformers.LlamaForCausalLM(cfg).float().eval()


BUILDERS = {"gpt2": gpt2, "llama": llama}


pytestmark = pytest.mark.usefixtures("one_thread")


def _prompts(n: int = 8) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, PROMPT), generator=torch.Generator().manual_seed(1))


def _linears(model) -> dict[str, torch.Tensor]:
    """name -> weight as (out, in) of every linear quantize_weights would replace."""
    uses: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    out = {}
    for name, m in model.named_modules():
        conv = type(m).__name__ == "Conv1D"
        if (isinstance(m, torch.nn.Linear) or conv) and uses[id(m.weight)] == 1:
            out[name] = (m.weight.t() if conv else m.weight).detach().clone()
    return out


# ------------------------------------------------------------------------- tensors


@pytest.mark.parametrize("in_f", [6, 7])
def test_int4_pack_round_trip(in_f):
    q = torch.randint(-7, 8, (5, in_f), dtype=torch.int8, generator=torch.Generator().manual_seed(0))
    packed = pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.shape == (5, math.ceil(in_f / 2))
    assert torch.equal(unpack_int4(packed, in_f), q)


@pytest.mark.parametrize("bits,group", SCHEMES)
def test_weights_on_the_grid_come_back_exactly(bits, group):
    g = torch.Generator().manual_seed(2)
    groups = 1 if group is None else 64 // group
    scale = torch.rand(4, groups, generator=g) + 0.5
    q = torch.randint(-QMAX[bits], QMAX[bits] + 1, (4, 64), generator=g).float()
    q[:, 0] = QMAX[bits]  # each group's absmax on the grid's end so the scale is recovered
    if group is not None:
        q[:, ::group] = QMAX[bits]
    w = (q.view(4, groups, -1) * scale.unsqueeze(-1)).view(4, 64)
    qq, s = quantize_tensor(w, bits, group)
    assert_close(s, scale, rtol=2e-7, atol=0)
    assert_close(dequantize(qq, s, bits, 64), w, rtol=1e-6, atol=0)


@pytest.mark.parametrize("family", BUILDERS)
@pytest.mark.parametrize("bits,group", SCHEMES)
def test_every_element_within_half_a_step(family, bits, group):
    model = BUILDERS[family]()
    original = _linears(model)
    quantize_weights(model, bits, group)
    seen = 0
    for name, w in original.items():
        layer = model.get_submodule(name)
        assert isinstance(layer, QuantizedLinear), name
        in_f = w.shape[1]
        steps = layer.scale.repeat_interleave(in_f // layer.scale.shape[1], dim=1)
        err = (layer.dequantize() - w).abs()
        assert bool((err <= steps * (0.5 + 2e-5)).all()), (name, float((err / steps).max()))
        ints = layer.qweight if bits == 8 else unpack_int4(layer.qweight, in_f)
        assert int(ints.abs().max()) == QMAX[bits], name  # the absmax maps to the grid's end
        seen += 1
    assert seen == {"gpt2": 8, "llama": 15}[family]  # GPT-2's lm_head is tied: kept


# -------------------------------------------------------------------------- module


@pytest.mark.parametrize("bits,group", [(8, None), (4, 16)])
def test_forward_is_linear_of_the_dequantized_weight(bits, group):
    torch.manual_seed(3)
    lin = torch.nn.Linear(32, 40)
    q = QuantizedLinear.from_module(lin, bits, group)
    chunked = QuantizedLinear.from_module(lin, bits, group, chunk_rows=16)
    w = q.dequantize()
    for shape in [(32,), (3, 32), (2, 5, 32), (2, 1, 3, 32)]:
        x = torch.randn(shape)
        want = F.linear(x, w, lin.bias)
        assert torch.equal(q(x), want)
        assert_close(chunked(x), want, rtol=1e-6, atol=1e-6)  # per-chunk GEMMs may block differently
    big = torch.nn.Linear(1024, 300)  # 300 * 1024 > 2^18: CPU default takes chunks of 256 rows
    auto, whole = QuantizedLinear.from_module(big, bits, group), QuantizedLinear.from_module(
        big, bits, group, chunk_rows=300)
    cpu = torch.device("cpu")
    assert (auto.rows_per_chunk(cpu), whole.rows_per_chunk(cpu)) == (256, 300)
    x = torch.randn(2, 3, 1024)
    with torch.no_grad():
        assert torch.equal(whole(x), F.linear(x, whole.dequantize(), big.bias))
        assert_close(auto(x), whole(x), rtol=1e-6, atol=1e-6)
    xb = torch.randn(4, 32).bfloat16()
    got = q(xb)  # fp32 scales and bias, bf16 compute
    assert got.dtype == torch.bfloat16
    assert_close(got, F.linear(xb, w.bfloat16(), lin.bias.bfloat16()), rtol=0, atol=0)


@pytest.mark.parametrize("bits", [8, 4])
def test_odd_input_width(bits):
    torch.manual_seed(5)
    lin = torch.nn.Linear(7, 5)
    q = QuantizedLinear.from_module(lin, bits)
    assert q.qweight.shape == (5, 7 if bits == 8 else 4)
    w = q.dequantize()
    assert bool(((w - lin.weight).abs() <= q.scale * (0.5 + 2e-5)).all())
    x = torch.randn(3, 7)
    with torch.no_grad():
        assert torch.equal(q(x), F.linear(x, w, lin.bias))


def test_conv1d_is_quantized_in_its_transposed_layout():
    conv = transformers.pytorch_utils.Conv1D(24, 16)  # nf=24 out, nx=16 in; weight (16, 24)
    with torch.no_grad():
        conv.weight.normal_()
        conv.bias.normal_()
    q = QuantizedLinear.from_module(conv, 8)
    assert (q.in_features, q.out_features) == (16, 24)
    w = q.dequantize()
    assert bool(((w - conv.weight.t()).abs() <= q.scale * (0.5 + 2e-5)).all())
    x = torch.randn(2, 3, 16)
    assert torch.equal(q(x), F.linear(x, w, conv.bias))


# -------------------------------------------------------------------------- memory


@pytest.mark.parametrize("family", BUILDERS)
@pytest.mark.parametrize("bits,group", SCHEMES)
def test_weight_bytes_formula(family, bits, group):
    model = BUILDERS[family]()
    shapes = [tuple(w.shape) for w in _linears(model).values()]
    fp32 = sum(4 * o * i for o, i in shapes)
    # Note [quantized weight bytes]: ints + 4-byte scales, one per output channel and group
    want = sum(o * (i if bits == 8 else math.ceil(i / 2)) + 4 * o * (1 if group is None else i // group)
               for o, i in shapes)
    quantize_weights(model, bits, group)
    assert weight_bytes(model) == want
    ratio = want / fp32
    base = 0.25 if bits == 8 else 0.125
    if group is not None:  # every in here is even: ratio is exactly base + 4 / (4 * group)
        assert ratio == pytest.approx(base + 1 / group, rel=1e-12)
    else:  # base + sum(out) / sum(out * in), in between 64 and 256 here
        assert base + 1 / 256 <= ratio <= base + 1 / 64
    print(f"\n{family} INT{bits} group={group}: {weight_bytes(model)} B quantized vs {fp32} B fp32, "
          f"ratio {ratio:.4f}")


# --------------------------------------------------------------------------- model

# Note [logit tolerance]: round-to-nearest leaves each weight an error uniform in
# ±s/2, rms s/sqrt(12). With s = absmax/qmax and absmax about 3.5x a row's rms for these
# 64..256-wide N(0, 0.02) rows, a layer's weight (and so output) relative rms error is
# about 3.5 / (qmax * sqrt(12)): 0.008 (INT8), 0.14 (INT4). Independent errors of the
# 3-4 linears on any path add in quadrature (x2), so logits should be near 0.016 (INT8)
# and 0.3 (INT4); the bounds sit at 2x / 1x of that. Groups only shrink s.
_LOGIT_TOL = {8: 0.03, 4: 0.3}


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("family", BUILDERS)
def test_logits_within_tolerance(family):
    ids = _prompts(4)
    ref = _logits(BUILDERS[family](), ids)
    rel = {}
    for bits, group in SCHEMES:
        got = _logits(quantize_weights(BUILDERS[family](), bits, group), ids)
        rel[bits, group] = float((got - ref).norm() / ref.norm())
        print(f"\n{family} INT{bits} group={group}: logits relative error {rel[bits, group]:.5f}")
        assert 0 < rel[bits, group] <= _LOGIT_TOL[bits], (bits, group, rel[bits, group])
    for group in (None, 32):  # the step is 127/7 = 18x larger, and so is the error
        assert 10 <= rel[4, group] / rel[8, group] <= 30, rel


@pytest.mark.parametrize("bits", [8, 4])
def test_bf16_model(bits):
    # A bf16 model keeps fp32 scales and bf16 biases and computes in bf16. Against the
    # fp32 model the error is the quantization's (_LOGIT_TOL) plus bf16's own (8-bit
    # mantissa: 2^-9 per rounding, ~0.01 over these few layers), so the bound is
    # _LOGIT_TOL + 0.02.
    ids = _prompts(4)
    ref = _logits(llama(), ids)
    model = quantize_weights(llama().to(torch.bfloat16), bits, 32)
    layer = model.model.layers[0].mlp.up_proj
    assert layer.scale.dtype == torch.float32 and layer.bias is None
    assert model.model.layers[0].self_attn.q_proj.qweight.dtype == (torch.int8 if bits == 8 else torch.uint8)
    got = _logits(model, ids)
    assert got.dtype == torch.bfloat16
    rel = float((got.float() - ref).norm() / ref.norm())
    print(f"\nllama bf16 INT{bits} group=32: logits relative error vs fp32 {rel:.5f}")
    assert rel <= _LOGIT_TOL[bits] + 0.02


def _generate(model, ids):
    model.generation_config.eos_token_id = None  # random weights: never stop early
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=NEW, pad_token_id=0)
    assert out.shape == (ids.shape[0], PROMPT + NEW)
    return out[:, PROMPT:]


@pytest.mark.parametrize("family", BUILDERS)
def test_greedy_agreement_over_64_tokens(family):
    ids = _prompts(8)
    ref = _generate(BUILDERS[family](), ids)
    for bits, group in [(8, None), (8, 32), (4, 32)]:
        got = _generate(quantize_weights(BUILDERS[family](), bits, group), ids)
        same = got == ref
        first = [int((~row).nonzero()[0]) if not bool(row.all()) else NEW for row in same]
        prefix, overall = sum(first) / (NEW * len(first)), float(same.float().mean())
        print(f"\n{family} INT{bits} group={group}: identical up to first divergence "
              f"{prefix:.3f}, over all {NEW} tokens {overall:.3f} (first divergence per prompt {first})")
        if bits == 8:
            # The measured prefixes are >= 0.5 (see the report); 0.25 leaves room for
            # a different BLAS and still fails if INT8 were as noisy as INT4.
            assert prefix >= 0.25, (family, group, first)


# --------------------------------------------------------------------------- model pass


def test_skip_tied_and_embeddings():
    model = quantize_weights(llama(), 8, skip=("lm_head", "*.mlp.down_proj"))
    assert isinstance(model.lm_head, torch.nn.Linear)
    assert all(isinstance(layer.mlp.down_proj, torch.nn.Linear) for layer in model.model.layers)
    assert all(isinstance(layer.mlp.up_proj, QuantizedLinear) for layer in model.model.layers)
    assert isinstance(model.model.embed_tokens, torch.nn.Embedding)
    g = quantize_weights(gpt2(), 4, 16)
    assert isinstance(g.lm_head, torch.nn.Linear)  # tied to wte
    assert g.lm_head.weight is g.transformer.wte.weight


def _held_bytes(model) -> int:
    """Bytes of every distinct parameter and buffer the model holds."""
    tensors = list(model.parameters()) + list(model.buffers())
    return sum({t.data_ptr(): t.nbytes for t in tensors}.values())


def test_nothing_dequantized_stays_resident():
    # Note [dequantize per call]: after forwards, the model holds no float copy of a
    # quantized weight: exactly the fp32 linears' bytes are replaced by weight_bytes.
    model = llama()
    before, linear_bytes = _held_bytes(model), sum(w.nbytes for w in _linears(model).values())
    quantize_weights(model, 4, 32)
    _logits(model, _prompts(2))
    assert _held_bytes(model) == before - linear_bytes + weight_bytes(model)


def test_multihead_attention_out_proj_kept():
    torch.manual_seed(4)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.MultiheadAttention(8, 2))
    quantize_weights(model, 8)
    assert isinstance(model[0], QuantizedLinear)
    assert type(model[1].out_proj).__name__ == "NonDynamicallyQuantizableLinear"


def test_bad_options_are_named():
    with pytest.raises(ValueError, match="bits must be 8 or 4"):
        quantize_weights(llama(), 3)
    with pytest.raises(ValueError, match="positive integer"):
        quantize_weights(llama(), 8, 0)
    model = llama()
    with pytest.raises(ValueError, match=r"group_size 48 does not divide model\.layers\.0\.self_attn\.q_proj's 64"):
        quantize_weights(model, 8, 48)
    assert not any(isinstance(m, QuantizedLinear) for m in model.modules())  # nothing replaced
    with pytest.raises(ValueError, match=r"skip pattern\(s\) \['lm_haed'\] match no module"):
        quantize_weights(model, 8, skip=("lm_haed",))
    quantize_weights(model, 8)
    with pytest.raises(ValueError, match="holds inf or NaN"):
        quantize_tensor(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ValueError, match="already has quantized layers"):
        quantize_weights(model, 4)


# ------------------------------------------------------------------ tensor parallelism


def _tp_logits(family: str, bits: int, group: int):
    import torch.distributed as dist

    from meshspeed.tensor_parallel import apply_tensor_parallel
    from meshspeed.tensor_parallel.losses import vocab_range
    from tests.tensor_parallel.parity import topology

    ids = _prompts(2)
    whole = quantize_weights(BUILDERS[family](), bits, group)
    split = apply_tensor_parallel(BUILDERS[family](), topology(2))
    quantize_weights(split, bits, group)
    n_parallel = sum(isinstance(m, QuantizedParallelLinear) for m in split.modules())
    total = torch.tensor([weight_bytes(split)])
    dist.all_reduce(total)
    head = split.lm_head.inner if isinstance(split.lm_head, QuantizedParallelLinear) else split.lm_head
    start, _ = vocab_range(head)  # the split model's logits are this rank's vocabulary slice
    local = _logits(split, ids)
    want = _logits(whole, ids).narrow(-1, start, local.shape[-1])
    err = float((local - want).abs().max())
    # Per output channel, a row layer's scales cover only this rank's input features
    # (finer than the whole layer's), so the result differs from the whole model's but
    # must still meet the INT8 tolerance against fp32.
    per_channel = quantize_weights(apply_tensor_parallel(BUILDERS[family](), topology(2)), bits)
    fp32 = _logits(BUILDERS[family](), ids).narrow(-1, start, local.shape[-1])
    rel = float((_logits(per_channel, ids) - fp32).norm() / fp32.norm())
    return err, n_parallel, int(total), weight_bytes(whole), rel


@pytest.mark.parametrize("family", BUILDERS)
def test_tensor_parallel_quantized_matches_whole(family):
    # group 16 divides every local input width at tp=2, so the split layers quantize
    # exactly as the whole ones do (Note [quantizing tensor-parallel layers]); what is
    # left is fp32 reassociation of the row layers' sums over ranks.
    for err, n_parallel, total, whole, rel in run_distributed(_tp_logits, world_size=2,
                                                         args=(family, 8, 16)):
        assert err <= 1e-5, err
        # every linear split (GPT-2's tied head kept, Llama's vocab-parallel head quantized)
        assert n_parallel == {"gpt2": 8, "llama": 15}[family]
        assert total == whole  # no padding at these sizes: the ranks' pieces add up
        print(f"\n{family} tp=2: max |logit diff| vs the whole model quantized alike {err:.2e}; "
              f"INT8 per-channel logits relative error vs fp32 {rel:.5f}")
        assert 0 < rel <= _LOGIT_TOL[8], rel
