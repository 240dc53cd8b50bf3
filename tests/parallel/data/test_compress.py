"""The gradient codecs of data parallelism, in one process: sizes, round-trip error
bounds, INT4 packing, top-k selection, and error feedback's conservation of the sum."""

import math

import pytest
import torch

from meshspeed.parallel.data.compress import GradCompression, Quantized, TopK


def _grad(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * torch.logspace(-3, 0, n)[torch.randperm(n, generator=g)]


@pytest.mark.parametrize("n", [1, 7, 256, 1000, 4097])
@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_round_trip_within_half_a_step(n, bits):
    codec = Quantized(n, bits=bits, chunk=256)
    x = _grad(n)
    payload = codec.encode(x)
    assert payload.dtype == torch.uint8 and payload.numel() == codec.payload_bytes
    chunks = math.ceil(n / 256)
    values = n if bits == 8 else (n + 1) // 2
    assert codec.payload_bytes == (4 * chunks + values + 3) // 4 * 4
    y = codec.decode(payload)
    qmax = 127 if bits == 8 else 7
    padded = torch.nn.functional.pad(x, (0, chunks * 256 - n)).view(chunks, 256)
    step = (padded.abs().amax(1) / qmax).repeat_interleave(256)[:n]
    assert torch.all((x - y).abs() <= step / 2 * (1 + 1e-5) + 1e-12)
    # the largest value of every chunk is exact (it is +-qmax steps)
    top = padded.abs().argmax(1) + torch.arange(chunks) * 256
    top = top[top < n]
    torch.testing.assert_close(y[top], x[top], rtol=1e-6, atol=0)


def test_int4_packs_two_values_per_byte():
    codec = Quantized(5, bits=4, chunk=2)
    x = torch.tensor([7.0, -7.0, 1.0, 0.0, -3.0])  # scales 1, 1/7, 3/7
    payload = codec.encode(x)
    assert codec.payload_bytes == (4 * 3 + 3 + 3) // 4 * 4  # 3 scales, ceil(5/2) bytes
    nibbles = payload[12:15]
    # element 2i in the low nibble, 2i+1 in the high one, stored as q + 8
    assert nibbles.tolist() == [(7 + 8) | ((-7 + 8) << 4), (7 + 8) | ((0 + 8) << 4), (-7 + 8) | (8 << 4)]
    torch.testing.assert_close(codec.decode(payload), x)


def test_zero_chunks_stay_zero():
    codec = Quantized(512, bits=4, chunk=256)
    x = torch.zeros(512)
    x[300] = 2.0
    assert torch.equal(codec.decode(codec.encode(x)), x)


def test_topk_keeps_the_largest_magnitudes():
    n = 1000
    x = _grad(n)
    codec = TopK(n, 0.01)
    assert codec.k == 10 and codec.payload_bytes == 80
    y = codec.decode(codec.encode(x))
    kept = y.nonzero().view(-1)
    assert set(kept.tolist()) == set(x.abs().topk(10).indices.tolist())
    assert torch.equal(y[kept], x[kept])
    assert TopK(5, 0.01).k == 1 and TopK(10, 1.0).k == 10  # k = ceil(ratio n), at least 1


@pytest.mark.parametrize("method", ["topk", "int8", "int4"])
def test_error_feedback_conserves_the_sum(method):
    """sum over steps of what was sent + the final residual == sum of the gradients."""
    n, steps = 3000, 20
    codec = GradCompression(method, ratio=0.05).codec(n)
    residual = torch.zeros(n, dtype=torch.float64)
    sent = torch.zeros(n, dtype=torch.float64)
    inputs = torch.zeros(n, dtype=torch.float64)
    for t in range(steps):
        g = _grad(n, seed=t)
        inputs += g.double()
        x = g + residual.float()
        d = codec.decode(codec.encode(x))
        residual = x.double() - d.double()
        sent += d.double()
    torch.testing.assert_close(sent + residual, inputs, rtol=0, atol=1e-5)
    # and the residual stays bounded: it does not grow with the number of steps
    assert residual.abs().max() < 20 * _grad(n).abs().max()
