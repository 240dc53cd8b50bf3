"""`zero.Init` builds exactly the model the ordinary constructor builds with the same seed:
Hugging Face GPT-2 (whose Conv1D has no reset_parameters), OPT and Llama (whose weights come
from `post_init` / `_init_weights`, after construction) and meshspeed's reference GPT; the
parameters and buffers are bit for bit equal and the generator ends in the same state.
`GatheredParameters` works on such a model before `meshspeed.initialize` (read, and modify
with modifier_rank=0 the way Hugging Face loads weights), and the model then trains like
the one-process reference. A parameter that is never initialised fails loudly, by name.
World sizes 1 and 2, gloo."""

import pytest
import torch
from torch import nn

import meshspeed
from meshspeed import comm
from meshspeed.testing import run_distributed
from meshspeed.testing.parity import full_state_dict
from tests.compat.models import KINDS, batches, build, loss, one_thread


def _whole(model) -> dict[str, torch.Tensor]:
    """Every parameter (gathered) and buffer, by name."""
    with meshspeed.zero.GatheredParameters(list(model.parameters())):
        out = {f"param {n}": p.detach().clone() for n, p in model.named_parameters()}
    out.update({f"buffer {n}": b.detach().clone() for n, b in model.named_buffers()})
    return out


def _built_under_init(kind, seed):
    torch.manual_seed(seed)
    plain = build(kind)
    expected = {f"param {n}": p.detach().clone() for n, p in plain.named_parameters()}
    expected.update({f"buffer {n}": b.detach().clone() for n, b in plain.named_buffers()})
    rng_after = torch.get_rng_state()
    torch.manual_seed(seed)
    with meshspeed.zero.Init():
        model = build(kind)
    same_rng = torch.equal(torch.get_rng_state(), rng_after)
    placeholders = all(p.numel() == 0 for p in model.parameters())  # nothing whole after Init
    got = _whole(model)
    after_gather = all(p.numel() == 0 for p in model.parameters())  # released again
    differ = sorted(k for k in expected if k not in got or not torch.equal(got[k], expected[k]))
    return differ, sorted(got) == sorted(expected), same_rng, placeholders, after_gather


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("kind", KINDS)
def test_init_builds_the_same_weights_as_the_plain_constructor(kind, world):
    for differ, same_names, same_rng, placeholders, after_gather in run_distributed(
            _built_under_init, world_size=world, args=(kind, 1234)):
        assert differ == []  # bit for bit: constructor writes, reset_parameters, post_init
        assert same_names
        assert same_rng  # the generator ends where the plain build leaves it
        assert placeholders and after_gather


def _ranks_seeded_differently(kind):
    torch.manual_seed(100 + comm.get_rank())  # a script that forgot to seed alike
    with meshspeed.zero.Init():
        model = build(kind)
    return _whole(model)


def test_every_rank_builds_rank_0s_model():
    got = run_distributed(_ranks_seeded_differently, world_size=2, args=("gpt2",))
    torch.manual_seed(100)
    plain = build("gpt2")
    for values in got:
        for name, p in plain.named_parameters():
            assert torch.equal(values[f"param {name}"], p.detach()), name


def _config(stage):
    return {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10_000,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 40}}


def _load_then_train(kind, stage, pretrained, data):
    """Hugging Face's way of loading weights into a zero.Init model: per module, gather its
    own parameters with modifier_rank=0 and let rank 0 write them; then train."""
    torch.manual_seed(0)
    with meshspeed.zero.Init():
        model = build(kind)
    for prefix, module in model.named_modules():
        params = list(module.parameters(recurse=False))
        with meshspeed.zero.GatheredParameters(params, modifier_rank=0):
            if comm.get_rank() == 0:
                with torch.no_grad():
                    for name, p in module.named_parameters(recurse=False):
                        p.copy_(pretrained[f"{prefix}.{name}" if prefix else name])
    with meshspeed.zero.GatheredParameters(list(model.parameters())):  # reading, before initialize
        loaded = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine, *_ = meshspeed.initialize(model=model, model_parameters=model.parameters(), config=_config(stage))
    losses = []
    for batch in data:  # the same batch on every rank: the reference sees it alone
        out = loss(kind, engine, batch)
        engine.backward(out)
        engine.step()
        losses.append(out.item())
    return loaded, losses, full_state_dict(engine)


@one_thread()
def _reference(kind, pretrained, data):
    model = build(kind)
    model.load_state_dict(pretrained)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for batch in data:
        out = loss(kind, model, batch)
        out.backward()
        opt.step()
        opt.zero_grad()
        losses.append(out.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("stage", [3, 2])
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_gathered_parameters_before_initialize_then_train(kind, stage):
    torch.manual_seed(77)  # the "checkpoint": another seed's weights
    pretrained = build(kind).state_dict()
    data = batches(3)
    ref_losses, ref_state = _reference(kind, pretrained, data)
    for loaded, losses, state in run_distributed(_load_then_train, world_size=2,
                                                 args=(kind, stage, pretrained, data)):
        for name, value in loaded.items():
            assert torch.equal(value, pretrained[name]), name
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-6, atol=0)
        for name, value in ref_state.items():
            torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)


class _Forgotten(nn.Module):
    """A parameter made with torch.empty that nothing initialises (or only half of it)."""

    def __init__(self, half: bool):
        super().__init__()
        self.ok = nn.Linear(4, 4)
        self.weight = nn.Parameter(torch.empty(4, 4))
        if half:
            with torch.no_grad():
                self.weight[:2].fill_(1.0)
        self.register_buffer("scratch", torch.empty(3))  # a buffer nothing writes: zeros


def _forgotten(half, written_later):
    with meshspeed.zero.Init():
        model = _Forgotten(half)
    if written_later:  # Hugging Face's way: init functions off while built, then rank 0 writes
        with meshspeed.zero.GatheredParameters([model.weight], modifier_rank=0):
            if comm.get_rank() == 0:
                with torch.no_grad():
                    model.weight.copy_(torch.arange(16.0).view(4, 4))
    try:
        engine, *_ = meshspeed.initialize(model=model, config={
            "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    except RuntimeError as err:
        return str(err)
    with meshspeed.zero.GatheredParameters([model.weight]):
        return model.weight.detach().clone()


def _unwritten_buffer():
    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.register_buffer("scratch", torch.empty(3))

    with meshspeed.zero.Init():
        model = Holder()
    return model.scratch.clone()


@pytest.mark.parametrize("half", [False, True])
def test_uninitialised_parameter_fails_loudly_by_name(half):
    (message,) = run_distributed(_forgotten, world_size=1, args=(half, False))
    assert isinstance(message, str), "initialize accepted a parameter nothing ever wrote"
    assert "'weight'" in message and "never completely initialised" in message, message


def test_parameter_written_after_the_build_by_rank_0_trains():
    """Note [initialised after the build]: rank 0's values, on every rank."""
    for weight in run_distributed(_forgotten, world_size=2, args=(True, True)):
        assert torch.equal(weight, torch.arange(16.0).view(4, 4))


def test_unwritten_buffer_is_zeros_not_garbage():
    (scratch,) = run_distributed(_unwritten_buffer, world_size=1)
    assert torch.equal(scratch, torch.zeros(3))


def _partition_built(kind):
    torch.manual_seed(3)
    model = build(kind)
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    meshspeed.zero.Init(module=model)  # DeepSpeed's form for a model built before
    placeholders = all(p.numel() == 0 and p.ds_status.name == "NOT_AVAILABLE" for p in model.parameters())
    got = _whole(model)
    return placeholders, all(torch.equal(got[f"param {n}"], v) for n, v in expected.items())


def test_init_of_a_built_module():
    for placeholders, same in run_distributed(_partition_built, world_size=2, args=("opt",)):
        assert placeholders and same
