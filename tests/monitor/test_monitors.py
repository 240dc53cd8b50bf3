"""Monitors on a 2-rank tiny-GPT run (gloo, world size 2): the CSV files hold the
engine's own numbers; TensorBoard and wandb either write or, when their package is
missing, stop initialize with an error naming it."""

import csv
import importlib.util
import os

import pytest
import torch

from meshspeed.monitor import CsvWriter
from meshspeed.testing import run_distributed
from meshspeed.testing.engines import small_engine

STEPS = 3


def _train_with_csv(out_dir, extra):
    from meshspeed import comm

    engine = small_engine(stage=1, csv_monitor={"enabled": True, "output_path": out_dir, "job_name": "job"},
                          gradient_clipping=1.0, **extra)
    torch.manual_seed(1 + comm.get_rank())  # each rank its own data, as data parallelism has
    losses, lrs, norms, samples = [], [], [], []
    for _ in range(STEPS):
        tokens = torch.randint(0, 16, (1, 4))
        loss = engine(tokens, tokens)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
        lrs.append(engine.get_lr()[0])
        norms.append(engine.get_global_grad_norm())
        samples.append(engine.global_samples)
    engine.destroy()
    return {"losses": losses, "lrs": lrs, "norms": norms, "samples": samples,
            "files": sorted(os.listdir(os.path.join(out_dir, "job"))) if comm.get_rank() == 0 else None}


def _read(path):
    with open(path) as f:
        rows = list(csv.reader(f))
    return rows[0], [(int(step), float(value)) for step, value in rows[1:]]


def test_csv_monitor_writes_the_engines_values(tmp_path):
    out = str(tmp_path)
    rank0, rank1 = run_distributed(_train_with_csv, world_size=2, args=(out, {}))
    job = tmp_path / "job"
    assert rank0["files"] == sorted([
        "Train_Samples_train_loss.csv", "Train_Samples_lr.csv", "Train_Samples_loss_scale.csv",
        "Train_Samples_grad_norm.csv", "Train_Samples_samples_per_second.csv",
        "Train_Samples_tokens_per_second.csv", "Train_Memory_peak_bytes_rank0.csv",
        "Train_Memory_peak_bytes_rank1.csv"])
    header, rows = _read(job / "Train_Samples_train_loss.csv")
    assert header == ["step", "Train/Samples/train_loss"]
    # DeepSpeed's x axis: samples so far (micro-batch 1 x 2 data-parallel ranks per step)
    assert [s for s, _ in rows] == rank0["samples"] == [2, 4, 6]
    assert [v for _, v in rows] == rank0["losses"]  # rank 0's loss, as DeepSpeed logs it
    assert rank0["losses"] != rank1["losses"]  # so the test tells the ranks apart
    assert [v for _, v in _read(job / "Train_Samples_lr.csv")[1]] == rank0["lrs"]
    assert [v for _, v in _read(job / "Train_Samples_grad_norm.csv")[1]] == rank0["norms"]
    assert [v for _, v in _read(job / "Train_Samples_loss_scale.csv")[1]] == [1.0] * STEPS
    for r in (0, 1):
        peaks = [v for _, v in _read(job / f"Train_Memory_peak_bytes_rank{r}.csv")[1]]
        assert len(peaks) == STEPS and all(p > 1e6 for p in peaks)  # a process holds megabytes
    tps = [v for _, v in _read(job / "Train_Samples_tokens_per_second.csv")[1]]
    sps = [v for _, v in _read(job / "Train_Samples_samples_per_second.csv")[1]]
    assert all(t == pytest.approx(4 * s) for t, s in zip(tps, sps))  # 4 tokens per sample


def test_csv_monitor_with_accumulation_averages_the_micro_losses(tmp_path):
    out = str(tmp_path)
    rank0, _ = run_distributed(_train_with_csv, world_size=2, args=(out, {"gradient_accumulation_steps": 3}))
    _, rows = _read(tmp_path / "job" / "Train_Samples_train_loss.csv")
    assert [s for s, _ in rows] == [6]  # one optimizer step of 3 micro-steps x 2 ranks
    assert rows[0][1] == pytest.approx(sum(rank0["losses"]) / 3, rel=1e-6)


def test_csv_writer_appends_one_row_per_event(tmp_path):
    writer = CsvWriter(str(tmp_path), "j")
    writer.write_events([("Train/Samples/lr", 0.5, 8), ("A/b", 1.25, 8)])
    writer.write_events([("Train/Samples/lr", 0.25, 16)])
    assert _read(tmp_path / "j" / "Train_Samples_lr.csv") == (["step", "Train/Samples/lr"], [(8, 0.5), (16, 0.25)])
    assert _read(tmp_path / "j" / "A_b.csv")[1] == [(8, 1.25)]


def _initialize_fails(block, value):
    try:
        small_engine(stage=0, **{block: value})
    except ImportError as err:
        return str(err)
    return None


def _fails_on_every_rank(block, value):
    """A missing package stops initialize on every rank with the same sentence (a rank
    left waiting in a collective would hang the job instead)."""
    says = f"`{block}` package is not installed; pip install {block}"
    errors = run_distributed(_initialize_fails, world_size=2, args=(block, value))
    assert all(e is not None and says in e for e in errors), errors


@pytest.mark.parametrize("block, value", [
    ("tensorboard", {"enabled": True, "job_name": "tb"}),
    ("wandb", {"enabled": True, "project": "p"}),
])
def test_tensorboard_and_wandb_write_or_name_the_missing_package(tmp_path, block, value):
    if block == "tensorboard":
        value = {**value, "output_path": str(tmp_path)}
    if importlib.util.find_spec(block) is None:
        _fails_on_every_rank(block, value)
        return
    if block == "wandb":
        pytest.skip("wandb is installed; logging in is outside what a unit test may do")
    run_distributed(_train_with_tensorboard, world_size=1, args=(str(tmp_path),))
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(tmp_path / "tb"))


def _train_with_tensorboard(out_dir):
    engine = small_engine(stage=0, tensorboard={"enabled": True, "output_path": out_dir, "job_name": "tb"})
    tokens = torch.randint(0, 16, (1, 4))
    engine.backward(engine(tokens, tokens))
    engine.step()
    engine.destroy()


def _pipeline_with_csv(out_dir):
    from torch import nn

    import meshspeed
    from meshspeed.parallel.pipeline.module import PipelineModule

    torch.manual_seed(0)
    net = PipelineModule([nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)], num_stages=2, loss_fn=nn.MSELoss())
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "csv_monitor": {"enabled": True, "output_path": out_dir, "job_name": "pipe"}}
    engine, *_ = meshspeed.initialize(model=net, config=config)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(2, 4, generator=g), torch.randn(2, 3, generator=g)) for _ in range(4)]
    losses = [float(engine.train_batch(iter(batches[i:i + 2]))) for i in (0, 2)]
    engine.destroy()
    return losses


def test_csv_monitor_on_a_pipeline_writes_train_batch_losses(tmp_path):
    """2 stages (world size 2): train_batch's mean loss is what the CSV holds."""
    rank0, _ = run_distributed(_pipeline_with_csv, world_size=2, args=(str(tmp_path),))
    _, rows = _read(tmp_path / "pipe" / "Train_Samples_train_loss.csv")
    assert rows == [(4, rank0[0]), (8, rank0[1])]  # 2 micro-batches of 2 samples per step
