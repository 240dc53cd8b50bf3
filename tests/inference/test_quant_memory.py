"""Issue 34, item 3: after `init_inference(model, dtype=fp32, quant={"enabled": True})` and
`del model`, the process holds less than the fp32 model, measured as the issue measures it:
the distinct storages of every live tensor (gc.get_objects(), deduplicated by storage).

The user-style run keeps teacher-forced logits from `engine(ids)` (grad mode on, as in a
script) and calls `engine.generate`. Before the fix the kept logits' autograd graph held
every quantized layer's rebuilt fp32 weight plus activations: 1.44x (GPT-2) and 1.42x
(Llama) of the fp32 model. Now what is live is exactly the engine's module (integer
weights, scales, and the embeddings, norms and biases kept in fp32) plus the tensors the
script holds. Note [no float weight in the graph] (quant.py), Note [a quantized model is
frozen] (engine.py)."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
import torch.nn.functional as F

from tests.inference.models import one_thread  # noqa: F401 - the fixture, by name

transformers = pytest.importorskip("transformers")

from meshspeed.inference import init_inference
from meshspeed.inference.quant import QuantizedLinear

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB, T = 128, 24


def _build(family: str):
    torch.manual_seed(0)
    if family == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64)
        return transformers.GPT2LMHeadModel(cfg).eval()
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                   max_position_embeddings=128)
    return transformers.LlamaForCausalLM(cfg).eval()


def _live_storages() -> dict[int, tuple[int, torch.Tensor]]:
    """data_ptr -> (bytes, one tensor on it) for every live tensor the gc can see."""
    gc.collect()
    found: dict[int, tuple[int, torch.Tensor]] = {}
    with warnings.catch_warnings():  # isinstance on torch.distributed's deprecated reduce_op warns
        warnings.simplefilter("ignore", FutureWarning)
        objects = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    for obj in objects:
        if obj.is_meta or obj.layout != torch.strided:
            continue
        try:
            storage = obj.untyped_storage()
            ptr = storage.data_ptr()
        except RuntimeError:
            # fake / functional tensors other tests' tracing left for the gc: no real memory
            continue
        found.setdefault(ptr, (storage.nbytes(), obj))
    return found


def _storage_bytes(tensors) -> dict[int, int]:
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_quantized_engine_holds_less_than_the_fp32_model(family):
    before = _live_storages()  # held here, so their addresses cannot be reused meanwhile
    model = _build(family)
    fp32_bytes = sum(_storage_bytes(list(model.parameters()) + list(model.buffers())).values())
    ids = torch.randint(2, VOCAB, (8, T), generator=torch.Generator().manual_seed(1))

    engine = init_inference(model, dtype=torch.float32, quant={"enabled": True})
    del model
    logits = engine(ids).logits  # teacher-forced, grad mode on, kept as a script keeps it
    out = engine.generate(ids[:2, :8], max_new_tokens=16)

    now = _live_storages()
    new = {ptr: n for ptr, (n, _) in now.items() if ptr not in before}
    module = engine.module
    held = _storage_bytes(list(module.parameters()) + list(module.buffers()) + [logits, out, ids])
    total = sum(new.values())
    # measured 0.58x (gpt2) and 0.61x (llama) with the kept logits; 5.8x and 5.1x at 8b07d02
    assert total < fp32_bytes, f"live tensors hold {total / fp32_bytes:.2f}x the fp32 model"
    assert new == held, "live storages other than the engine's module and the script's tensors"
    engine_bytes = sum(_storage_bytes(list(module.parameters()) + list(module.buffers())).values())
    assert engine_bytes < 0.4 * fp32_bytes, (engine_bytes, fp32_bytes)  # 0.354 gpt2, 0.333 llama
    assert not any(p.requires_grad for p in module.parameters())  # Note [a quantized model is frozen]

    # Teacher-forced greedy agreement with the fp32 model (the issue accepts 0.98).
    with torch.no_grad():
        want = _build(family)(ids).logits
    agree = float((logits.argmax(-1) == want.argmax(-1)).float().mean())
    print(f"\n{family}: live {total / fp32_bytes:.3f}x fp32 (engine {engine_bytes / fp32_bytes:.3f}x), "
          f"teacher-forced agreement {agree:.3f}")
    assert agree >= 0.98, agree


@pytest.mark.parametrize("chunk_rows", [None, 5])
def test_input_gradient_saves_no_float_weight(chunk_rows):
    torch.manual_seed(3)
    linear = torch.nn.Linear(32, 12)
    layer = QuantizedLinear.from_module(linear, 8, 16, chunk_rows=chunk_rows)
    x = torch.randn(3, 4, 32, requires_grad=True)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = layer(x)
    # nothing float is saved for backward: neither the rebuilt weight (or its chunks) nor x
    assert [tuple(t.shape) for t in saved if t.is_floating_point()] == []
    grad_y = torch.randn_like(y)
    y.backward(grad_y)
    w = layer.dequantize()
    ref_x = x.detach().clone().requires_grad_(True)
    F.linear(ref_x, w, layer.bias).backward(grad_y)
    torch.testing.assert_close(y, F.linear(x.detach(), w, layer.bias))
    torch.testing.assert_close(x.grad, ref_x.grad)
