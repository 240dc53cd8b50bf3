"""Executing every schedule on 1, 2 and 4 gloo ranks (meshspeed/parallel/pipeline/runtime.py).

For GPipe, 1F1B, interleaved (2 chunks per stage) and ZB-H1, one worker per case trains
two batches and evaluates a third:
  * the losses and every parameter gradient equal a one-process run of the same model on
    the same micro-batches, and loss_scale 4 gives 4x the gradients, the same losses;
  * every parameter's post-accumulate hook fires once per micro-batch, inside grad_pass,
    which sees every B/I/W action and flags exactly the final one `last`;
  * the timeline has one span per action, in order, none overlapping;
  * train=False (with forward_only's list) gives the model's outputs and losses and
    touches no gradient.
A model passing (hidden, int mask, unused float) between stages (the unused float's
parameters keep .grad None, as in one process), a shape change named on
both stages, and the errors for schedules the runtime cannot execute are covered too.
"""

import contextlib
import itertools

import pytest
import torch
from torch import nn

from meshspeed import comm
from meshspeed.parallel.pipeline.partition import partition
from meshspeed.parallel.pipeline.runtime import PipelineShapeError, run_stage
from meshspeed.parallel.pipeline.schedule import Action, build, forward_only, fuse_adjacent_halves
from meshspeed.testing import run_distributed

M = 4  # micro-batches: a multiple of 2 and 4 stages, as the interleaved schedule needs
mse = nn.functional.mse_loss


def _layers():
    """8 Linear layers, so that 4 stages x 2 chunks each get one."""
    torch.manual_seed(0)
    sizes = [6, 8, 8, 8, 8, 8, 8, 8, 3]
    layers = []
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        layers += [nn.Linear(a, b)] + ([nn.Tanh()] if i < len(sizes) - 2 else [])
    return layers


def _data():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(5, 6, generator=g) for _ in range(M)], [torch.randn(5, 3, generator=g) for _ in range(M)]


def _reference():
    model = nn.Sequential(*_layers())
    xs, ys = _data()
    losses, outputs = [], []
    for x, y in zip(xs, ys):
        out = model(x)
        loss = mse(out, y)
        losses.append(float(loss.detach()))
        outputs.append(out.detach())
        (loss / M).backward()
    return losses, [p.grad.clone() for p in model.parameters()], outputs


def _rank_run(rank, stages, schedule, v):
    """One rank's three batches; see the module docstring."""
    layers = _layers()
    bounds = partition(layers, stages * v, "parameters")
    counts = [sum(1 for _ in layer.parameters()) for layer in layers]
    chunks, params = [], {}
    for g in range(rank, stages * v, stages):  # chunk c is virtual stage c * stages + rank
        chunks.append(nn.Sequential(*layers[bounds[g] : bounds[g + 1]]))
        params.update(enumerate(chunks[-1].parameters(), start=sum(counts[: bounds[g]])))
    fired = dict.fromkeys(params, 0)
    outside, active, log = [], [False], []

    @contextlib.contextmanager
    def grad_pass(kind, micro, chunk, last):
        log.append((kind, micro, chunk, last))
        active[0] = True
        yield
        active[0] = False

    def hook(i):
        def count(_):
            fired[i] += 1
            if not active[0]:
                outside.append(i)
        return count

    for i, p in params.items():
        p.register_post_accumulate_grad_hook(hook(i))
    xs, ys = _data()
    actions = build(schedule, M, stages, v)[rank]
    first, last = rank == 0, rank == stages - 1

    def batch(plan=actions, **kw):
        return run_stage(chunks if v > 1 else chunks[0], plan, stage=rank, stages=stages, group=None,
                         inputs=xs if first else None, targets=ys if last else None, loss_fn=mse, **kw)

    spans = []
    losses = batch(grad_pass=grad_pass, timeline=spans)
    grads = {i: p.grad.clone() for i, p in params.items()}
    fired_once, outside_once = dict(fired), list(outside)  # (later batches run without grad_pass)
    for p in params.values():
        p.grad = None
    losses4 = batch(loss_scale=4.0)
    grads4 = {i: p.grad.clone() for i, p in params.items()}
    outputs = []
    eval_losses = batch(forward_only(M, stages, rank, v), train=False, outputs=outputs)
    untouched = all(torch.equal(p.grad, grads4[i]) for i, p in params.items())
    return {"actions": [(a.kind, a.micro, a.chunk) for a in actions], "losses": losses, "grads": grads,
            "losses4": losses4, "grads4": grads4, "fired": fired_once, "outside": outside_once, "log": log,
            "spans": spans, "outputs": outputs, "eval_losses": eval_losses,
            "eval_untouched": untouched and sum(fired.values()) == 2 * sum(fired_once.values())}


def _worker(schedule, v):
    return _rank_run(comm.get_rank(), comm.get_world_size(), schedule, v)


def _check(results):
    ref_losses, ref_grads, ref_outputs = _reference()
    last = results[-1]
    for key in ("losses", "losses4", "eval_losses"):
        assert last[key] == pytest.approx(ref_losses, rel=1e-6), key
    assert len(last["outputs"]) == M
    for got, want in zip(last["outputs"], ref_outputs):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    got, got4 = {}, {}
    for r in results:
        got.update(r["grads"])
        got4.update(r["grads4"])
        assert r["eval_untouched"], "train=False changed a gradient or fired a hook"
    assert sorted(got) == list(range(len(ref_grads)))
    for k, g in enumerate(ref_grads):
        torch.testing.assert_close(got[k], g, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(got4[k], 4 * g, rtol=1e-5, atol=1e-7)
    for rank, r in enumerate(results):
        assert set(r["fired"].values()) == {M}, f"rank {rank}: hooks fired {r['fired']}"
        assert r["outside"] == [], f"rank {rank}: hooks fired outside grad_pass for {r['outside']}"
        # an I followed at once by its own W runs as one B (Note [an I right before its W is a B])
        executed = [(a.kind, a.micro, a.chunk) for a in fuse_adjacent_halves([Action(*t) for t in r["actions"]])]
        passes = [a for a in executed if a[0] != "F"]
        assert [entry[:3] for entry in r["log"]] == passes
        assert [entry[3] for entry in r["log"]] == [False] * (len(passes) - 1) + [True]
        spans = r["spans"]
        assert [(s.kind, s.micro, s.chunk) for s in spans] == executed
        assert all(s.start <= s.end for s in spans)
        assert all(a.end <= b.start for a, b in itertools.pairwise(spans)), f"rank {rank}: spans overlap"


@pytest.mark.parametrize("schedule,v,world", [
    ("gpipe", 1, 2), ("1f1b", 1, 2), ("1f1b", 1, 4), ("interleaved", 2, 2), ("interleaved", 2, 4),
    ("zb-h1", 1, 2), ("zb-h1", 1, 4),
])
def test_every_schedule_equals_one_process(schedule, v, world):
    _check(run_distributed(_worker, world_size=world, args=(schedule, v)))


@pytest.mark.parametrize("schedule,v", [("interleaved", 2), ("zb-h1", 1)])
def test_one_stage_runs_in_process(schedule, v):
    """One stage, no process group: interleaved chunks hand activations to each other
    locally (Note [virtual stages and their neighbours])."""
    _check([_rank_run(0, 1, schedule, v)])


# -- tuples between stages -------------------------------------------------------------------------
class _Embed(nn.Module):
    """(x, mask) -> (hidden masked by rows, the int mask, a float nobody downstream uses)."""

    def __init__(self):
        super().__init__()
        self.fc, self.aux = nn.Linear(6, 8), nn.Linear(6, 2)

    def forward(self, inputs):
        x, mask = inputs
        return self.fc(x) * mask[:, None], mask, self.aux(x)


class _Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 3)

    def forward(self, inputs):
        h, mask, _unused = inputs
        return self.fc(torch.tanh(h)) * mask[:, None]


def _tuple_model():
    torch.manual_seed(0)
    return _Embed(), _Head()


def _tuple_data():
    xs, ys = _data()
    g = torch.Generator().manual_seed(2)
    return [(x, torch.randint(0, 2, (5,), generator=g)) for x in xs], ys


def _tuple_worker(schedule):
    rank = comm.get_rank()
    module = _tuple_model()[rank]
    xs, ys = _tuple_data()
    losses = run_stage(module, build(schedule, M, 2)[rank], stage=rank, stages=2, group=None,
                       inputs=xs if rank == 0 else None, targets=ys if rank == 1 else None, loss_fn=mse)
    return losses, [None if p.grad is None else p.grad.clone() for p in module.parameters()]


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_tuple_activations_with_an_int_mask(schedule):
    embed, head = _tuple_model()
    xs, ys = _tuple_data()
    ref = []
    for x, y in zip(xs, ys):
        loss = mse(head(embed(x)), y)
        ref.append(float(loss.detach()))
        (loss / M).backward()
    (_, first), (losses, second) = run_distributed(_tuple_worker, world_size=2, args=(schedule,))
    assert losses == pytest.approx(ref, rel=1e-6)
    for got, p in zip(first + second, [*embed.parameters(), *head.parameters()]):
        torch.testing.assert_close(got, p.grad, rtol=1e-5, atol=1e-7)
    assert first[2] is None and first[3] is None  # aux: its output went unused downstream


# -- errors ----------------------------------------------------------------------------------------
class _Shrinks(nn.Module):
    """Its output loses a row on the third micro-batch."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        y = self.fc(x)
        return y[:-1] if self.calls == 3 else y


def _shrinking(compression):
    rank = comm.get_rank()
    xs, ys = _data()
    module = _Shrinks() if rank == 0 else nn.Linear(6, 3)
    try:
        run_stage(module, build("gpipe", M, 2)[rank], stage=rank, stages=2, group=None,
                  inputs=xs if rank == 0 else None, targets=ys if rank == 1 else None, loss_fn=mse,
                  compression=compression)
    except PipelineShapeError as err:
        return str(err)
    return None


@pytest.mark.parametrize("compression", ["none", "int8"])
def test_a_shape_change_mid_batch_is_named_on_both_stages(compression):
    """Also with compressed activations (the receive posted for the first shape gets a
    compressed buffer of zeros)."""
    sender, receiver = run_distributed(_shrinking, world_size=2, args=(compression,), timeout=60)
    assert sender is not None and "micro-batch 2's output is (4, 6)" in sender and "was (5, 6)" in sender
    assert receiver is not None and "micro-batch 2's input from stage 0 is (4, 6)" in receiver


@pytest.mark.parametrize("actions,message", [
    ([Action("F", 0, 1)], "is for chunk 1, but stage 0 was given 1 module"),
    ([Action("F", 0), Action("W", 0)], "runs before the input half I0"),
    ([Action("F", 0), Action("I", 0)], "never their weight half W"),
    ([Action("F", 0), Action("B", 0), Action("I", 0)], "both a whole backward B and an input half I"),
    ([Action("F", 0), Action("F", 0)], "F0 appears twice"),
    ([Action("F", 0)], "forwarded and never backwarded"),
    ([Action("X", 0)], "kind 'X' is not one of F, B, I, W"),
])
def test_a_schedule_the_runtime_cannot_execute_is_named(actions, message):
    with pytest.raises((ValueError, RuntimeError), match=message):
        run_stage(nn.Linear(6, 3), actions, stage=0, stages=1, group=None, inputs=_data()[0],
                  targets=_data()[1], loss_fn=mse)


def test_the_last_stage_needs_a_loss_to_train_but_not_to_evaluate():
    xs, _ = _data()
    with pytest.raises(ValueError, match="needs loss_fn and the micro-batches' targets"):
        run_stage(nn.Linear(6, 3), build("gpipe", M, 1)[0], stage=0, stages=1, group=None, inputs=xs)
    outputs = []
    assert run_stage(nn.Linear(6, 3), build("gpipe", M, 1)[0], stage=0, stages=1, group=None,
                     inputs=xs, train=False, outputs=outputs) == []
    assert len(outputs) == M and not outputs[0].requires_grad


# -- message order ---------------------------------------------------------------------------------
def _misordered_pairs(schedule, p, v):
    """The (sender, receiver) stage pairs whose messages, by the runtime's rules, are sent in
    an order other than the one they are received in."""
    sends, recvs = {}, {}
    for s, actions in enumerate(schedule):
        for a in actions:
            g = a.chunk * p + s
            if a.kind == "F" and g > 0:
                recvs.setdefault(((g - 1) % p, s), []).append(("activation", a.micro, g - 1))
            if a.kind == "F" and g < p * v - 1:
                sends.setdefault((s, (g + 1) % p), []).append(("activation", a.micro, g))
            if a.kind in "BI" and g < p * v - 1:
                recvs.setdefault(((g + 1) % p, s), []).append(("gradient", a.micro, g + 1))
            if a.kind in "BI" and g > 0:
                sends.setdefault((s, (g - 1) % p), []).append(("gradient", a.micro, g))
    return [pair for pair in set(sends) | set(recvs) if sends.get(pair) != recvs.get(pair)]


@pytest.mark.parametrize("name,v", [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved", 2),
                                    ("interleaved", 3)])
def test_every_pair_of_stages_receives_in_the_order_it_is_sent(name, v):
    """What would let NCCL, which ignores tags, pair the messages (Note [one tag per message])."""
    for p in (2, 3, 4, 8):
        for m in (p, 2 * p, 4 * p):
            assert _misordered_pairs(build(name, m, p, v), p, v) == [], (name, v, p, m)
