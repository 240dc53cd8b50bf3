"""The kernel registry: every implementation equals the plain path, dispatch and fallback.

Tolerances: fp32 rtol 1e-5 / atol 1e-6 (a fused or compiled kernel may sum in another
order). bf16 rtol/atol 2**-6: bf16 keeps 8 significant bits (one ulp is 2**-7 relative),
and a fused kernel keeps its intermediates (x + residual, the normalised x) in fp32 where
the plain path rounds each to bf16, so results may differ by the rounding of two steps.
fp16 (CUDA only) likewise at 2**-9 (11 significant bits).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

from meshspeed.inference import kernels

TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-6}, torch.bfloat16: {"rtol": 2**-6, "atol": 2**-6},
       torch.float16: {"rtol": 2**-9, "atol": 2**-9}}  # fp16: 11 significant bits, two roundings


@pytest.fixture(autouse=True)
def _restore_registry():
    """Each test sees and leaves the registry as import made it."""
    fast = {op: list(impls) for op, impls in kernels._FAST.items()}
    proven, failed, mode = set(kernels._proven), set(kernels._failed), kernels._mode
    yield
    kernels._FAST.clear()
    kernels._FAST.update(fast)
    kernels._proven.clear()
    kernels._proven.update(proven)
    kernels._failed.clear()
    kernels._failed.update(failed)
    kernels._set_mode(mode)


def _noncontig(*shape, dtype=torch.float32):
    # (..., T, H) as a transposed view of (..., H, T): same values, strides (.., 1, T).
    return torch.randn(*shape[:-2], shape[-1], shape[-2]).transpose(-1, -2).to(dtype)


def op_cases(op: str, dtype: torch.dtype):
    """Several argument tuples per op: contiguous and non-contiguous, 2-D to 4-D."""
    torch.manual_seed(0)
    cases = []
    for shape, contig in (((3, 16), True), ((2, 5, 32), True), ((2, 5, 32), False),
                          ((2, 3, 4, 16), False)):
        def r(*s, c=contig):
            return torch.randn(*s).to(dtype) if c else _noncontig(*s, dtype=dtype)
        h = shape[-1]
        w = torch.randn(h).to(dtype)
        if op == "rms_norm":
            cases.append((r(*shape), w, 1e-6))
        elif op == "add_rms_norm":
            cases.append((r(*shape), r(*shape), w, 1e-6))
        elif op == "layer_norm":
            cases.append((r(*shape), w, torch.randn(h).to(dtype) if contig else None, 1e-5))
        elif op == "add_layer_norm":
            cases.append((r(*shape), r(*shape), w, torch.randn(h).to(dtype), 1e-5))
        elif op == "rotary":
            cs = torch.randn(shape[-2], h).to(dtype)
            cases.append((r(*shape), cs.cos(), cs.sin()))
        elif op == "bias_gelu":
            cases.append((r(*shape), w if contig else None, "tanh" if contig else "none"))
        elif op == "silu_mul":
            cases.append((r(*shape), torch.randn(*shape).to(dtype)))
    return cases


ELEMENTWISE = [op for op in kernels.OPS if op != "fused_qkv"]


def assert_same(got, want, dtype):
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        torch.testing.assert_close(g, w, **TOL[dtype])


# ---- every supported implementation equals the plain path ------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op", ELEMENTWISE)
def test_public_op_equals_plain(op, dtype):
    fn = getattr(kernels, op)
    for args in op_cases(op, dtype):
        with kernels.use("plain"):
            want = fn(*args)
        assert_same(fn(*args), want, dtype)
        assert_same(want, kernels._PLAIN[op](*args), dtype)


def test_plain_rms_norm_is_the_formula():
    x, w = torch.randn(2, 3, 8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    want = w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    with kernels.use("plain"):
        torch.testing.assert_close(kernels.rms_norm(x, w, 1e-6), want)


def test_plain_rotary_rotates_half():
    # Each (x_i, x_{i+D/2}) pair is rotated by the angle whose cos/sin are given.
    x = torch.randn(1, 3, 8)
    ang = torch.randn(3, 4).repeat(1, 2)
    got = kernels._plain_rotary(x, ang.cos(), ang.sin())
    a, b, c, s = x[..., :4], x[..., 4:], ang[:, :4].cos(), ang[:, :4].sin()
    torch.testing.assert_close(got, torch.cat((a * c - b * s, b * c + a * s), -1))


@pytest.fixture(scope="module")
def compile_works():
    try:
        torch.compile(lambda t: t * 2 + 1, dynamic=True)(torch.ones(3))
    except Exception as err:  # noqa: BLE001
        pytest.skip(f"torch.compile does not work here ({type(err).__name__}: {err})")


def _supported_here():
    found = [(op, impl.label, dtype) for op in ELEMENTWISE for impl in kernels._FAST[op]
             for dtype in (torch.float32, torch.bfloat16) if impl.supports("cpu", dtype)]
    return found or [pytest.param(None, None, None, marks=pytest.mark.skip(
        reason="no implementation but plain is supported on this CPU"))]


@pytest.mark.parametrize("op,label,dtype", _supported_here())
def test_every_registered_impl_supported_here_equals_plain(op, label, dtype, request):
    """The implementation itself, not the dispatcher (whose min_numel would send these tiny
    inputs to plain). A compiled one gets one non-contiguous 3-D shape: each compilation
    costs 5-15 s on this machine."""
    impl = next(i for i in kernels._FAST[op] if i.label == label)
    cases = op_cases(op, dtype)
    if label == "compiled":
        request.getfixturevalue("compile_works")
        cases = cases[2:3]
        assert not cases[0][0].is_contiguous()
    for args in cases:
        assert_same(impl.fn(*args), kernels._PLAIN[op](*args), dtype)


def test_preferred_compiled_ops_are_the_measured_ones():
    table = kernels.describe(("cpu", torch.float32), ("cpu", torch.bfloat16))
    for op, pays in kernels._COMPILED_PAYS.items():
        for dtype in (torch.float32, torch.bfloat16):
            want = "compiled" if dtype in pays else "plain"
            assert table[op][f"cpu/{dtype}"] == want, (op, dtype)
    assert table["fused_qkv"] == {"cpu/torch.float32": "plain", "cpu/torch.bfloat16": "plain"}
    assert kernels._COMPILED_PAYS["rms_norm"] == {torch.bfloat16}  # the Note's table


def test_small_inputs_run_plain_below_min_numel():
    calls = []
    kernels.register("silu_mul", _spy(calls), lambda d, t: True, priority=100, label="spy",
                     min_numel=64)
    for n in (8, 63, 64, 100):
        kernels.silu_mul(torch.ones(n), torch.ones(n))
    assert len(calls) == 2


def test_min_numel_first_real_call_is_the_one_guarded():
    # Small calls prove nothing: the implementation's first call is its first large one.
    calls = []
    kernels.register("silu_mul", _spy(calls, fail=True), lambda d, t: True, priority=100,
                     label="broken", min_numel=64)
    kernels.silu_mul(torch.ones(8), torch.ones(8))
    big = torch.randn(64)
    torch.testing.assert_close(kernels.silu_mul(big, big), kernels._plain_silu_mul(big, big))
    kernels.silu_mul(big, big)
    assert len(calls) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA kernels need a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("op", ELEMENTWISE)
def test_cuda_impls_equal_plain(op, dtype):
    for args in op_cases(op, dtype):
        args = tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in args)
        want = kernels._PLAIN[op](*args)
        for impl in kernels._FAST[op]:
            if not impl.supports("cuda", dtype):
                continue
            assert_same(impl.fn(*args), want, dtype)  # the impl itself: no min_numel


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA kernels need a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_fused_qkv_packed_by_default(dtype):
    q, k, v = (torch.nn.Linear(64, n).to("cuda", dtype) for n in (64, 32, 32))
    x = torch.randn(4, 3, 64, device="cuda", dtype=dtype)
    with torch.inference_mode():
        got = kernels.fused_qkv(x, q, k, v)
        assert kernels._packs.get(q) is not None
        assert_same(tuple(got), _three(x, q, k, v), dtype)


# ---- dispatch ---------------------------------------------------------------------------

def _spy(calls: list, result=None, fail: bool = False):
    def impl(gate, up):
        calls.append(gate.dtype)
        if fail:
            raise RuntimeError("no compiler here")
        return kernels._plain_silu_mul(gate, up) if result is None else result
    return impl


def test_registered_impl_runs_where_supported_and_plain_elsewhere():
    calls = []
    kernels.register("silu_mul", _spy(calls), lambda d, t: d == "cpu" and t == torch.float32,
                     priority=100, label="spy")
    a, b = torch.randn(4, 8), torch.randn(4, 8)
    kernels.silu_mul(a, b)
    kernels.silu_mul(a.bfloat16(), b.bfloat16())
    assert calls == [torch.float32]
    table = kernels.describe(("cpu", torch.float32), ("cpu", torch.bfloat16))
    assert table["silu_mul"]["cpu/torch.float32"] == "spy"
    assert table["silu_mul"]["cpu/torch.bfloat16"] != "spy"


def test_higher_priority_wins():
    low, high = [], []
    kernels.register("silu_mul", _spy(low), lambda d, t: True, priority=50, label="low")
    kernels.register("silu_mul", _spy(high), lambda d, t: True, priority=60, label="high")
    kernels.silu_mul(torch.randn(2), torch.randn(2))
    assert (low, high) == ([], [torch.float32])


def test_use_plain_forces_plain_and_restores():
    calls = []
    kernels.register("silu_mul", _spy(calls), lambda d, t: True, priority=100, label="spy")
    a, b = torch.randn(4, 8), torch.randn(4, 8)
    with kernels.use("plain"):
        torch.testing.assert_close(kernels.silu_mul(a, b), kernels._plain_silu_mul(a, b))
        table = kernels.describe()
        assert {label for row in table.values() for label in row.values()} == {"plain"}
    assert calls == []
    kernels.silu_mul(a, b)
    assert calls == [torch.float32]


def test_supported_but_not_preferred_runs_only_when_asked():
    calls = []
    kernels.register("silu_mul", _spy(calls), lambda d, t: True, priority=100, label="slow",
                     prefer=lambda d, t: False)
    a, b = torch.randn(2), torch.randn(2)
    kernels.silu_mul(a, b)
    assert calls == []
    with kernels.use("slow"):
        kernels.silu_mul(a, b)
    assert calls == [torch.float32]
    kernels.silu_mul(a, b)  # mode restored: "auto" again
    assert calls == [torch.float32]


def test_use_label_forces_that_impl():
    spy, other = [], []
    kernels.register("silu_mul", _spy(spy), lambda d, t: True, priority=1, label="spy")
    kernels.register("silu_mul", _spy(other), lambda d, t: True, priority=100, label="other")
    kernels.use("spy")
    kernels.silu_mul(torch.randn(2), torch.randn(2))
    assert (spy, other) == ([torch.float32], [])
    assert kernels.describe(("cpu", torch.float32))["rms_norm"] == {"cpu/torch.float32": "plain"}


def test_env_forces_plain():
    code = ("from meshspeed.inference import kernels;"
            "print(sorted({l for r in kernels.describe().values() for l in r.values()}))")
    env = dict(os.environ, MESHSPEED_KERNELS="plain", PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['plain']"


def test_failing_impl_falls_back_once_and_is_remembered(caplog):
    calls = []
    kernels.register("silu_mul", _spy(calls, fail=True), lambda d, t: True, priority=100,
                     label="broken")
    a, b = torch.randn(4, 8), torch.randn(4, 8)
    with caplog.at_level(logging.WARNING, logger="meshspeed"):
        first = kernels.silu_mul(a, b)
        second = kernels.silu_mul(a, b)
    torch.testing.assert_close(first, kernels._plain_silu_mul(a, b))
    torch.testing.assert_close(second, first)
    assert calls == [torch.float32]  # tried once, not again
    lines = [r.getMessage() for r in caplog.records if "broken" in r.getMessage()]
    assert len(lines) == 1 and "no compiler here" in lines[0], lines
    key = ("cpu", torch.float32)
    assert kernels.describe(key)["silu_mul"]["cpu/torch.float32"] != "broken"
    # Another dtype is its own key: tried there too.
    kernels.silu_mul(a.bfloat16(), b.bfloat16())
    assert calls == [torch.float32, torch.bfloat16]


def test_only_the_first_call_is_guarded():
    calls = []

    def works_once(gate, up):
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("a bug in a proven implementation")
        return kernels._plain_silu_mul(gate, up)

    kernels.register("silu_mul", works_once, lambda d, t: True, priority=100, label="once")
    kernels.silu_mul(torch.ones(2), torch.ones(2))
    with pytest.raises(RuntimeError, match="a bug in a proven"):  # not hidden by a fallback
        kernels.silu_mul(torch.ones(2), torch.ones(2))


def test_input_error_is_not_blamed_on_the_impl():
    calls = []
    kernels.register("silu_mul", _spy(calls, fail=True), lambda d, t: True, priority=100,
                     label="broken")
    with pytest.raises(RuntimeError, match="size of tensor"):
        kernels.silu_mul(torch.randn(3), torch.randn(4))  # plain raises too: the input's fault
    assert ("broken", ("silu_mul", "cpu", torch.float32)) not in kernels._failed
    kernels.silu_mul(torch.randn(3), torch.randn(3))
    assert len(calls) == 2  # tried again on the next call


def test_bad_names_are_one_sentence():
    with pytest.raises(ValueError, match="'silu' is not an op"):
        kernels.register("silu", lambda g, u: g, lambda d, t: True)
    with pytest.raises(ValueError, match="reserved"):
        kernels.register("silu_mul", lambda g, u: g, lambda d, t: True, label="plain")
    with pytest.raises(ValueError, match="'fastest' names no implementation"):
        kernels.use("fastest")
    kernels._set_mode("fastest")  # as MESHSPEED_KERNELS=fastest would at import
    with pytest.raises(ValueError, match="'fastest' .*MESHSPEED_KERNELS.* names no"):
        kernels.rms_norm(torch.ones(2), torch.ones(2), 1e-6)


# ---- fused_qkv ----------------------------------------------------------------------------

@pytest.fixture
def packed():
    """The packed path is preferred on CUDA only (Note [fused_qkv's packed weight])."""
    kernels.use("packed")


def _three(x, q, k, v):
    return q(x), k(x), v(x)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("contig", [True, False])
def test_fused_qkv_linear_equals_three_projections(bias, contig, packed):
    torch.manual_seed(0)
    q, k, v = torch.nn.Linear(32, 32, bias), torch.nn.Linear(32, 16, bias), torch.nn.Linear(32, 16, bias)
    x = torch.randn(2, 5, 32) if contig else _noncontig(2, 5, 32)
    with torch.no_grad():
        got = kernels.fused_qkv(x, q, k, v)
        assert kernels._packs.get(q) is not None  # the packed path ran
        assert_same(tuple(got), _three(x, q, k, v), torch.float32)


def test_fused_qkv_hf_conv1d_and_mixed(packed):
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    q, k, v = Conv1D(24, 16), Conv1D(8, 16), torch.nn.Linear(16, 8, bias=False)
    for m in (q, k):
        torch.nn.init.normal_(m.bias)
    x = torch.randn(3, 4, 16)
    with torch.no_grad():
        got = kernels.fused_qkv(x, q, k, v)
        assert kernels._packs.get(q) is not None
        assert_same(tuple(got), _three(x, q, k, v), torch.float32)


class _OwnForward(torch.nn.Linear):
    """Stands for a quantized or tensor-parallel layer: a forward of its own."""

    calls = 0

    def forward(self, x):
        type(self).calls += 1
        return super().forward(x) * 2


def test_fused_qkv_calls_modules_that_are_not_plain_linears(packed):
    q, k, v = torch.nn.Linear(8, 8), _OwnForward(8, 8), torch.nn.Linear(8, 8)
    x = torch.randn(2, 8)
    _OwnForward.calls = 0
    with torch.no_grad():
        got = kernels.fused_qkv(x, q, k, v)
    assert _OwnForward.calls == 1 and kernels._packs.get(q) is None
    assert_same(tuple(got), _three(x, q, k, v), torch.float32)


def test_fused_qkv_calls_modules_whose_weight_is_a_tensor_subclass(packed):
    class Marked(torch.Tensor):  # stands for a quantized or distributed weight tensor
        pass

    q, k, v = (torch.nn.Linear(8, 8) for _ in range(3))
    with torch.no_grad():
        k.weight = torch.nn.Parameter(k.weight.detach().as_subclass(Marked))
        assert type(k.weight) is not torch.nn.Parameter
        got = kernels.fused_qkv(torch.ones(2, 8), q, k, v)
    assert kernels._packs.get(q) is None
    assert_same(tuple(got), _three(torch.ones(2, 8), q, k, v), torch.float32)


def test_fused_qkv_respects_hooks_and_autograd(packed):
    q, k, v = (torch.nn.Linear(8, 8) for _ in range(3))
    seen = []
    handle = k.register_forward_pre_hook(lambda m, a: seen.append(m))
    with torch.no_grad():
        kernels.fused_qkv(torch.randn(2, 8), q, k, v)
    assert seen == [k]
    handle.remove()
    out = kernels.fused_qkv(torch.randn(2, 8), q, k, v)  # grad enabled, weights need grad
    sum(o.sum() for o in out).backward()
    assert all(m.weight.grad is not None for m in (q, k, v))


def test_fused_qkv_pack_is_cached_and_rebuilt_when_a_weight_changes(packed):
    q, k, v = (torch.nn.Linear(8, 8) for _ in range(3))
    x = torch.randn(2, 8)
    with torch.no_grad():
        kernels.fused_qkv(x, q, k, v)
        pack = kernels._packs[q]
        kernels.fused_qkv(x, q, k, v)
        assert kernels._packs[q] is pack  # reused
        v.weight.mul_(3)  # in place: the version counter moves
        assert_same(tuple(kernels.fused_qkv(x, q, k, v)), _three(x, q, k, v), torch.float32)
        assert kernels._packs[q] is not pack
        pack = kernels._packs[q]
        k.weight = torch.nn.Parameter(torch.randn(8, 8))  # replaced: a new tensor
        assert_same(tuple(kernels.fused_qkv(x, q, k, v)), _three(x, q, k, v), torch.float32)
        assert kernels._packs[q] is not pack
        other = torch.nn.Linear(8, 8)  # same q, another v module
        assert_same(tuple(kernels.fused_qkv(x, q, k, other)), _three(x, q, k, other),
                    torch.float32)


def test_fused_qkv_forced_plain_calls_the_modules():
    q, k, v = (torch.nn.Linear(8, 8) for _ in range(3))
    with kernels.use("plain"), torch.no_grad():
        kernels.fused_qkv(torch.randn(2, 8), q, k, v)
    assert kernels._packs.get(q) is None


def test_fused_qkv_bf16_within_tolerance(packed):
    q, k, v = (torch.nn.Linear(16, 16).bfloat16() for _ in range(3))
    x = torch.randn(2, 3, 16).bfloat16()
    with torch.inference_mode():
        assert_same(tuple(kernels.fused_qkv(x, q, k, v)), _three(x, q, k, v), torch.bfloat16)
