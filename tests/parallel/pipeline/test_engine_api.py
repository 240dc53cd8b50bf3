"""The pipelined engine's DeepSpeed API and its errors: train_batch / eval_batch /
is_first_stage / is_last_stage, split_sequential, only the owner builds a LayerSpec, and
one clear sentence for each way a pipelined run can be set up wrong."""

import pytest
import torch
from torch import nn

import meshspeed
from meshspeed.config import ConfigError
from meshspeed.parallel.pipeline.module import LayerSpec, PipelineModule, split_sequential
from meshspeed.parallel.pipeline.partition import PartitionError
from meshspeed.testing import run_distributed

CFG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
       "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "steps_per_print": 1000}

BUILT: list[int] = []


class Recorded(nn.Linear):
    """A Linear that notes, per process, which positions were materialised (partitioning
    counts parameters on the meta device, which allocates nothing)."""

    def __init__(self, index: int, d_in: int, d_out: int):
        super().__init__(d_in, d_out)
        if self.weight.device.type != "meta":
            BUILT.append(index)


def _specs():
    return [LayerSpec(Recorded, 0, 4, 8), nn.Tanh(), LayerSpec(Recorded, 2, 8, 8), nn.Tanh(),
            LayerSpec(Recorded, 4, 8, 3)]


def _batches(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(2, 4, generator=g), torch.randn(2, 3, generator=g)) for _ in range(n)]


def _api_worker():
    BUILT.clear()
    net = PipelineModule(_specs(), num_stages=2, loss_fn=nn.MSELoss(), seed_layers=True)
    built = sorted(BUILT)
    engine, *_ = meshspeed.initialize(model=net, config=dict(CFG))
    loss = engine.train_batch(iter(_batches(4)))
    eval_loss, outputs = engine.eval_batch(iter(_batches(4, seed=1)), return_logits=True)
    try:
        engine(torch.zeros(2, 4))
        plain = None
    except meshspeed.pipe.PipelineError as err:
        plain = str(err)
    return {"built": built, "first": engine.is_first_stage(), "last": engine.is_last_stage(),
            "loss": float(loss), "eval": float(eval_loss),
            "outputs": None if outputs is None else [o.shape for o in outputs], "plain": plain,
            "names": [n for n, _ in engine.module.named_parameters()]}


def _reference():
    net = PipelineModule(_specs(), num_stages=1, loss_fn=nn.MSELoss(), seed_layers=True)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    losses = []
    for x, y in _batches(4):
        loss = net.loss_fn(net(x), y)
        losses.append(loss.item())
        (loss / 4).backward()
    opt.step()
    with torch.no_grad():
        evals = [net.loss_fn(net(x), y).item() for x, y in _batches(4, seed=1)]
    return sum(losses) / 4, sum(evals) / 4


def test_train_and_eval_batch_on_two_stages():
    first, last = run_distributed(_api_worker, world_size=2)
    assert first["built"] == [0] and last["built"] == [2, 4]  # only the owner builds (40 | 72 + 27 parameters)
    assert (first["first"], first["last"], last["first"], last["last"]) == (True, False, False, True)
    assert first["names"] == ["0.weight", "0.bias"] and last["names"] == ["2.weight", "2.bias", "4.weight", "4.bias"]
    ref_loss, ref_eval = _reference()
    for r in (first, last):  # the mean loss on every rank
        assert r["loss"] == pytest.approx(ref_loss, rel=1e-6)
        assert r["eval"] == pytest.approx(ref_eval, rel=1e-6)
    assert first["outputs"] is None and last["outputs"] == [torch.Size([2, 3])] * 4
    assert "train_batch()" in first["plain"]


def test_split_sequential_keeps_names_and_function():
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    net = split_sequential(seq, 1, loss_fn=nn.MSELoss())
    x = torch.randn(3, 4)
    torch.testing.assert_close(net(x), seq(x))
    assert [n for n, _ in net.named_parameters()] == [n for n, _ in seq.named_parameters()]
    with pytest.raises(ValueError, match="no child modules"):
        split_sequential(nn.Linear(2, 2), 1)


def test_more_stages_than_layers_is_named():
    with pytest.raises(PartitionError, match="3 pipeline stages for 2 layers"):
        PipelineModule([nn.Linear(2, 2), nn.Linear(2, 2)], num_stages=3)


def test_a_partition_that_leaves_a_stage_empty_is_named():
    layers = [nn.Linear(2, 2), nn.ReLU(), nn.ReLU()]
    with pytest.raises(PartitionError, match="fewer than the 2 stages"):
        PipelineModule(layers, num_stages=2, partition_method="type:Linear")


def _setup_error(config, loss_fn="mse", virtual=1):
    net = PipelineModule(_specs() + [nn.Identity()], num_stages=2, loss_fn=nn.MSELoss() if loss_fn else None,
                         virtual_stages=virtual, partition_method="uniform")
    try:
        meshspeed.initialize(model=net, config=config)
    except ConfigError as err:
        return str(err)
    return None


def _errors_worker():
    return {
        "loss_fn": _setup_error(dict(CFG), loss_fn=None),
        "few_micro": _setup_error({**CFG, "gradient_accumulation_steps": 3, "pipeline": {"schedule": "interleaved"}},
                                  virtual=2),
        "chunks": _setup_error({**CFG, "pipeline": {"schedule": "interleaved"}}),
        "stages": _setup_error({**CFG, "pipeline": {"stages": 4}}),
        "schedule": _setup_error({**CFG, "pipeline": {"schedule": "zb-h2"}}),
    }


def test_setup_errors_are_one_sentence_each():
    errors = run_distributed(_errors_worker, world_size=2)[0]
    assert errors["loss_fn"] is None  # DeepSpeed builds an engine without a loss (forward, eval_batch)
    assert "multiples" in errors["few_micro"] and "gradient_accumulation_steps = 3" in errors["few_micro"]
    assert "virtual_stages=2" in errors["chunks"]
    assert "pipeline.stages: 4" in errors["stages"] and "num_stages=2" in errors["stages"]
    assert "zb-h2" in errors["schedule"]


def _no_loss_worker():
    net = PipelineModule(_specs(), num_stages=2, loss_fn=None)
    engine, *_ = meshspeed.initialize(model=net, config=dict(CFG))
    out = engine.eval_batch(iter(_batches(4)), compute_loss=False, return_logits=True)[1]
    try:
        engine.train_batch(iter(_batches(4)))
    except meshspeed.pipe.PipelineError as err:
        return out is None or len(out) == 4, str(err)
    return None


def test_a_pipeline_without_loss_evaluates_and_refuses_to_train():
    for ok, message in run_distributed(_no_loss_worker, world_size=2):
        assert ok and "loss_fn" in message and "CrossEntropyLoss" in message


def _dry_worker(kind):
    net = PipelineModule(_specs(), num_stages=2, loss_fn=nn.MSELoss())
    engine, *_ = meshspeed.initialize(model=net, config=dict(CFG))
    data = _batches(3) if kind == "dry" else [torch.zeros(2, 4)] * 4
    try:
        engine.train_batch(iter(data))
    except meshspeed.pipe.PipelineError as err:
        return str(err)
    return None


@pytest.mark.parametrize("kind", ["dry", "not_a_pair"])
def test_a_bad_data_iterator_fails_every_stage(kind):
    messages = run_distributed(_dry_worker, world_size=2, args=(kind,))
    assert all(m is not None for m in messages)  # every stage raises, none hangs
    if kind == "dry":
        assert "ran dry after 3 of the 4 micro-batches" in messages[0]
    else:
        assert "pair (inputs, labels)" in messages[0]


def _topology_worker():
    from meshspeed.pipe import PipelineModule as DeepSpeedPipelineModule
    from meshspeed.pipe import PipeModelDataParallelTopology

    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=1)
    net = DeepSpeedPipelineModule(_specs(), topology=topo, loss_fn=nn.MSELoss())
    try:
        meshspeed.initialize(model=net, config=dict(CFG))
    except ConfigError as err:
        return str(err)
    return None


def test_a_model_axis_without_tensor_parallelism_is_named():
    message = run_distributed(_topology_worker, world_size=4)[0]
    assert "model axis of 2" in message and '"autotp_size": 2' in message


def _one_stage_worker():
    net = PipelineModule(_specs(), num_stages=1, loss_fn=nn.MSELoss(), seed_layers=True)
    engine, *_ = meshspeed.initialize(model=net, config={**CFG, "gradient_accumulation_steps": 2})
    rank = engine.mesh.coord("dp")
    batches = [(x[rank : rank + 1], y[rank : rank + 1]) for x, y in _batches(4)]
    loss = engine.train_batch(iter(batches[:2]))
    return type(engine).__name__, float(loss), float(engine._last_loss), engine.is_first_stage() and engine.is_last_stage()


def test_one_stage_pipeline_module_trains_with_train_batch():
    """DeepSpeed gives a PipelineModule of one stage its pipeline engine too (the example's -p 1)."""
    (name, loss, logged, ends), other = run_distributed(_one_stage_worker, world_size=2)
    assert name == "PipelineEngine" and ends and loss == logged == pytest.approx(other[1], rel=1e-6)
    net = PipelineModule(_specs(), num_stages=1, loss_fn=nn.MSELoss(), seed_layers=True)
    with torch.no_grad():  # the mean over both ranks' rows of the first two micro-batches
        ref = sum(net.loss_fn(net(x[r : r + 1]), y[r : r + 1]).item() for x, y in _batches(2) for r in (0, 1)) / 4
    assert loss == pytest.approx(ref, rel=1e-6)
