"""Compressed activations between stages (`pipeline.activation_compression`; Note
[compressed activations between stages] in meshspeed/parallel/pipeline/compress.py).

* encode/decode in one process: bf16 within 2^-8 of each element, int8 within
  max|row| / 254, a row of zeros exact, a row with inf or nan all nan, integer tensors
  and 2-byte floats under bf16 untouched.
* the bytes on the link, 2 ranks: CommCounter's "send" bytes of one micro-batch, exactly.
* training: pp=2 GPTPipe under each mode against the uncompressed run.
"""

import pytest
import torch

from meshspeed import comm
from meshspeed.comm.counter import CommCounter
from meshspeed.parallel.pipeline.compress import decode, encode, wire_bytes, wire_mode
from meshspeed.parallel.pipeline.p2p import Link, PipelineShapeError
from meshspeed.testing import run_distributed
from meshspeed.testing.parity import ParitySetup, engine_runs

B, T, D = 2, 8, 32  # a micro-batch's hidden state: B * T = 16 tokens of D = 32
HEADER = 96  # bytes, one per tensor of an activation (Note [shapes once, ...] in p2p.py)


def _roundtrip(x, mode):
    wire = wire_mode(x.dtype, mode)
    return decode(encode(x, wire), x.shape, x.dtype, wire)


def test_bf16_is_within_its_rounding_of_each_element():
    x = torch.randn(B, T, D, generator=torch.Generator().manual_seed(0)) * 100
    y = _roundtrip(x, "bf16")
    assert y.dtype == torch.float32 and not torch.equal(y, x)
    assert ((y - x).abs() <= x.abs() * 2**-8).all()
    for dtype in (torch.float16, torch.bfloat16, torch.int64):  # 2-byte floats, ints: as they are
        assert wire_mode(dtype, "bf16") == "none"


def test_int8_is_within_half_a_step_of_its_row():
    x = torch.randn(B, T, D, generator=torch.Generator().manual_seed(0))
    x[0, 1] = 0
    x[1, 2] *= 1e4  # one row's scale does not touch the others
    x[1, 3, 5] = float("inf")
    x[1, 4, 0] = float("nan")
    y = _roundtrip(x, "int8")
    assert y.shape == x.shape and y.dtype == x.dtype
    step = x.abs().amax(dim=-1, keepdim=True) / 127
    finite = x.isfinite().all(dim=-1)
    assert ((y - x).abs() <= step / 2 * (1 + 1e-6))[finite].all()
    assert torch.equal(y[0, 1], x[0, 1])
    assert y[1, 3].isnan().all() and y[1, 4].isnan().all()  # an fp16 overflow stays visible
    assert y.isfinite()[finite].all()
    mask = torch.randint(0, 2, (B, T))
    assert wire_mode(mask.dtype, "int8") == "none" and torch.equal(_roundtrip(mask, "int8"), mask)
    for shape in [(), (5,), (3, 0), (0, 4)]:
        assert _roundtrip(torch.randn(shape), "int8").shape == shape
    half = x[0].to(torch.bfloat16)  # a bf16 activation is quantized too, and comes back bf16
    assert _roundtrip(half, "int8").dtype == torch.bfloat16
    bound = float(half.abs().max()) * (1 / 254 + 2**-8)  # half a step, then bf16's rounding
    torch.testing.assert_close(_roundtrip(half, "int8"), half, rtol=0, atol=bound)


# -- bytes on the link (2 ranks) --------------------------------------------------------------------
def _link_worker(modes):
    """Stage 0 sends (hidden fp32, int64 mask) for 3 micro-batches, stage 1 sends the
    hidden's gradient back; the bytes each rank sends and receives, per micro-batch."""
    rank = comm.get_rank()
    g = torch.Generator().manual_seed(0)
    hidden, grad = torch.randn(B, T, D, generator=g), torch.randn(B, T, D, generator=g)
    mask = torch.randint(0, 2, (B, T), generator=g)
    out = {}
    for mode in modes:
        link, counted, got = Link(rank, 2, 1, None, compression=mode), [], []
        for micro in range(3):  # the first micro-batch reads headers first, later ones not
            with CommCounter() as counter:
                if rank == 0:
                    link.send_activation((hidden, mask), micro, 0)
                    got.append(link.recv_grads([hidden], micro, 0)[0])
                else:
                    got.append(link.recv_activation(micro, 0))
                    link.send_grads([grad], micro, 0)
            link.drain()
            summary = counter.summary()
            counted.append((summary["send"]["bytes"], summary["recv"]["bytes"]))
        out[mode] = counted, got
    return out, hidden, grad, mask


def test_bytes_on_the_link_per_micro_batch():
    """Per micro-batch, an fp32 hidden of N = 2 x 8 x 32 = 512 elements (16 tokens) goes
    as 4N = 2048 bytes uncompressed, 2N = 1024 as bf16 (1/2), N + 4 * 16 = 576 as int8
    (1/4 + a 4-byte scale per token). Stage 0 sends 2 headers (192 bytes), the int64 mask
    (128, never compressed) and the hidden; stage 1 one int64 flag (8) and the gradient,
    the same size as the hidden. Each side receives what the other sent."""
    modes = ("none", "bf16", "int8")
    first, second = run_distributed(_link_worker, world_size=2, args=(modes,))
    _, hidden, grad, mask = first
    payload = {"none": 4 * B * T * D, "bf16": 2 * B * T * D, "int8": B * T * D + 4 * B * T}
    assert payload["bf16"] * 2 == payload["none"] and payload["int8"] == payload["none"] // 4 + 4 * B * T
    activation, gradient = 2 * HEADER + 8 * B * T, 8  # besides the payload
    for mode in modes:
        assert wire_bytes(hidden.shape, hidden.dtype, mode) == payload[mode]
        counted, grads = first[0][mode]
        assert counted == [(activation + payload[mode], gradient + payload[mode])] * 3, mode
        counted, inputs = second[0][mode]
        assert counted == [(gradient + payload[mode], activation + payload[mode])] * 3, mode
        for g, (h, m) in zip(grads, inputs):  # what arrived is what decode gives, exactly
            assert torch.equal(g, _roundtrip(grad, mode)) and torch.equal(h, _roundtrip(hidden, mode))
            assert torch.equal(m, mask)
        assert torch.equal(h, hidden) == (mode == "none")


def test_a_peer_compressing_otherwise_is_named():
    """The header says how the data travels; the engine gives every stage the same mode,
    a Link used directly may not (here one stage with two chunks, messages kept locally)."""
    link = Link(0, 1, 2, None, compression="int8")
    link.send_activation(torch.randn(B, T, D), micro=0, chunk=0)
    link.compression = "none"
    with pytest.raises(PipelineShapeError, match=r"sent as int8, but this stage's activation compression is 'none'"):
        link.recv_activation(micro=0, chunk=1)


# -- training ---------------------------------------------------------------------------------------
STEPS = 12
BASE = {"world": 2, "pp": 2, "steps": STEPS, "gas": 4, "micro": 2, "seq": 8, "model": {"n_layer": 4}}


INTERLEAVED = {"schedule": "interleaved", "virtual": 2, "model": {"n_layer": 6}}  # 8 layers, 4 runs


def _compressed(mode, **changes):
    return ParitySetup(**{**BASE, **changes}, extra_config={"pipeline": {"activation_compression": mode}})


def test_compressed_training_stays_within_rounding_of_the_uncompressed_run():
    """pp=2 GPTPipe (1F1B, AdamW, clipping), 12 steps: "none" is the uncompressed run bit
    for bit; "bf16" and "int8" give every step's loss within rtol 1e-3 of it, and so
    does "int8" under the interleaved schedule (2 chunks a stage: 3 hidden states cross
    the link each way per micro-batch).

    Why 1e-3: the hidden state (16 tokens x 32 per micro-batch) and its gradient cross
    the link once each way per micro-batch, each element off by at most 2^-8 = 3.9e-3 of
    itself (bf16) or max|token| / 254 = 3.9e-3 of its token's largest element (int8). The
    loss is a mean over tokens, and those roundings are independent and of both signs, so
    their first-order effect on it averages out far below one element's bound; 1e-3 is a
    quarter of it. Observed over 12 steps: at most 3.4e-5 (bf16) and 7.1e-5 (int8), the
    first step (forward rounding only, same parameters) 3e-6 and 2e-6; interleaved int8
    at most 7.3e-5.
    Parameters are not compared: AdamW turns a gradient element near zero into a +-lr
    step whatever its size, so the compressed runs' parameters drift by up to lr per step
    in such elements (up to 8% of a parameter tensor's largest element after 12 steps) while the
    losses stay this close.
    """
    setups = [ParitySetup(**BASE), _compressed("none"), _compressed("bf16"), _compressed("int8"),
              ParitySetup(**{**BASE, **INTERLEAVED}), _compressed("int8", **INTERLEAVED)]
    (default, none, bf16, int8, interleaved, interleaved_int8), _ = run_distributed(
        engine_runs, world_size=2, args=(setups,), timeout=300)
    assert none[0] == default[0] and all(torch.equal(none[1][k], v) for k, v in default[1].items())
    for mode, (losses, _), (ref, _) in (("bf16", bf16, default), ("int8", int8, default),
                                        ("interleaved int8", interleaved_int8, interleaved)):
        assert losses != ref, f"{mode}: compression changed nothing"
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-3, atol=0,
                                   msg=lambda m, mode=mode: f"{mode}: {m}")
