"""DeepSpeed pipeline, tensor-parallel and universal checkpoints loaded in meshspeed: the
losses after loading.

Pipeline: DeepSpeed 0.19.8 (the anchor venv) trains a 5-layer LayerSpec model (Linear 6->10,
Tanh, Linear 10->8, Tanh, Linear 8->3; MSE loss) as a 2-stage PipelineModule (pp 2, dp 1,
fp32, 2 micro-batches of 2 rows per batch) for 2 batches, saves, and a fresh DeepSpeed
engine loads the checkpoint and trains 3 more batches: the reference losses. meshspeed then
loads the same directory into its PipelineModule at pp 2 and pp 1 and into a plain
nn.Sequential of the same layers (names "0.weight", "2.weight", ... as the pipeline's),
and trains the same 3 batches.

Tensor-parallel: DeepSpeed trains a 1-layer Llama (transformers; hidden 16, vocab 32) with
AutoTP (`"tensor_parallel": {"autotp_size": 2}`, ZeRO 1, fp32) for 2 steps, saves
(mp_rank_00/01 files), and a fresh engine loads and trains 3 more steps; meshspeed loads the
same directory at tp 2 (its AutoTP) and tp 1 and trains the same steps.

Universal: DeepSpeed trains the plain 5-layer model at ZeRO 1 or 2, dp 2, saves, converts
the tag with its own `python -m deepspeed.checkpoint.ds_to_universal`, and a fresh
DeepSpeed engine with `"checkpoint": {"load_universal": true}` loads the universal tag and
trains 3 more steps; meshspeed loads the universal tag (with and without the key) at dp 1
and 2 and trains the same steps.

    PYTHONPATH=. .venv/bin/python benchmarks/ds_checkpoint_pptp.py [--json out.json]
    PYTHONPATH=. .venv/bin/python benchmarks/ds_checkpoint_pptp.py --write-fixtures

`--write-fixtures` writes tests/checkpoint/fixtures/deepspeed/{pipe_pp2_z0, pipe_pp2_z1,
autotp_tp2_z1, universal_z2_dp2}/: the DeepSpeed checkpoint (`ckpt/`, a few KB; for the universal one also
`source/`, the ZeRO 2 checkpoint ds_to_universal converted) and `expected.json` with
DeepSpeed's losses after loading, so CI checks the loading without DeepSpeed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from anchor_ranks import ANCHOR_PY, REPO, enter_rank, run_degree, spawn_ranks

MICRO, GAS = 2, 2  # rows per micro-batch, micro-batches per batch (pipeline: dp 1)
SAVE_AT, MORE = 2, 3
FIXTURES = REPO / "tests" / "checkpoint" / "fixtures" / "deepspeed"


def layer_list(LayerSpec):
    from torch import nn

    return [LayerSpec(nn.Linear, 6, 10), LayerSpec(nn.Tanh), LayerSpec(nn.Linear, 10, 8), LayerSpec(nn.Tanh),
            LayerSpec(nn.Linear, 8, 3)]


def sequential(seed: int):
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 8), nn.Tanh(), nn.Linear(8, 3))


def tiny_llama(seed: int):
    """A 1-layer Llama (hidden 16, 2 heads, vocab 32) that DeepSpeed's AutoTP splits."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2))


def tp_config(tp: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "betas": [0.9, 0.99], "eps": 1e-6}},
            "zero_optimization": {"stage": 1}, "gradient_clipping": 1.0, "steps_per_print": 10_000,
            **({"tensor_parallel": {"autotp_size": tp}} if tp > 1 else {})}


def tp_train(engine, first: int, last: int) -> list[float]:
    """The same 2 x 8 token batch on every rank (tp ranks see the same data)."""
    import torch

    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 32, (2, 8), generator=g) for _ in range(SAVE_AT + MORE)]
    losses = []
    for b in range(first, last):
        loss = engine(input_ids=ids[b], labels=ids[b]).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses


def micro_batches():
    """(SAVE_AT + MORE) * GAS micro-batches of MICRO rows, the same on both sides."""
    import torch

    g = torch.Generator().manual_seed(1)
    n = (SAVE_AT + MORE) * GAS
    return [(torch.randn(MICRO, 6, generator=g), torch.randn(MICRO, 3, generator=g)) for _ in range(n)]


def config(stage: int, dp: int, universal: bool = False, clip: float = 1.0) -> dict:
    cfg = {"train_batch_size": MICRO * GAS, "train_micro_batch_size_per_gpu": MICRO,
           "gradient_accumulation_steps": GAS // dp,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "betas": [0.9, 0.99], "eps": 1e-6}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                        "warmup_num_steps": 10}},
           "zero_optimization": {"stage": stage},
           "gradient_clipping": clip,
           "steps_per_print": 10_000}
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    return cfg


# Note [the pipeline without ZeRO is not clipped here]
# DeepSpeed 0.19.8's gradient clipping without ZeRO (runtime/utils.clip_grad_norm_ with the
# pipeline grid as mpu) counts a parameter only on model-parallel rank 0 unless it is a
# tensor-parallel one, and a pipeline's model-parallel ranks are its stages: the norm it
# clips by leaves out every stage but the first (its ZeRO 1 path takes all stages). Its
# stage-0 pipeline losses then differ from its own ZeRO 1 ones once a norm exceeds the
# limit; that is a training difference, not a checkpoint one, so the ZeRO 0 pipeline
# cases say gradient_clipping 0 on both sides (ZeRO 1 keeps 1.0, DeepSpeed's default).
def pipe_clip(stage: int) -> float:
    return 0.0 if stage == 0 else 1.0


def pipe_train(engine, first: int, last: int) -> list[float]:
    data = micro_batches()
    return [float(engine.train_batch(iter(data[b * GAS:(b + 1) * GAS]))) for b in range(first, last)]


def plain_train(engine, first: int, last: int, rank: int, dp: int) -> list[float]:
    """Batches [first, last) of the plain model: micro-batch i of batch b goes to dp rank
    i % dp (dp * GAS' micro-batches per batch); the mean loss over the batch."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    data = micro_batches()
    gas = GAS // dp
    losses = []
    for b in range(first, last):
        total = torch.zeros(1)
        for i in range(gas):
            x, y = data[b * GAS + i * dp + rank]
            loss = F.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            total += loss.detach()
        dist.all_reduce(total)
        losses.append(total.item() / GAS)
    return losses


# -- DeepSpeed side (anchor venv) ---------------------------------------------------------------
def _ds_rank(rank: int, world: int, port: int, plan: dict, out: str) -> None:
    enter_rank(rank, world, port)
    import deepspeed
    import torch
    from deepspeed.pipe import LayerSpec, PipelineModule
    from torch import nn

    deepspeed.init_distributed(dist_backend="gloo")

    def pipe(seed):
        torch.manual_seed(seed)
        return PipelineModule(layers=layer_list(LayerSpec), num_stages=world, loss_fn=nn.MSELoss(),
                              partition_method="uniform")

    if plan["kind"] == "pipe":
        cfg = config(plan["stage"], 1, clip=pipe_clip(plan["stage"]))
        net = pipe(0)
        engine, *_ = deepspeed.initialize(model=net, model_parameters=[p for p in net.parameters()], config=cfg)
        before = pipe_train(engine, 0, SAVE_AT)
        engine.save_checkpoint(plan["ckpt"], client_state={"epoch": 3})
        net2 = pipe(7)
        engine2, *_ = deepspeed.initialize(model=net2, model_parameters=[p for p in net2.parameters()],
                                           config=cfg)
        engine2.load_checkpoint(plan["ckpt"])
        after = pipe_train(engine2, SAVE_AT, SAVE_AT + MORE)
    elif plan["kind"] == "tp":
        cfg = tp_config(world)
        model = tiny_llama(0)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        before = tp_train(engine, 0, SAVE_AT)
        engine.save_checkpoint(plan["ckpt"], client_state={"epoch": 3})
        fresh = tiny_llama(7)
        engine2, *_ = deepspeed.initialize(model=fresh, model_parameters=fresh.parameters(), config=cfg)
        engine2.load_checkpoint(plan["ckpt"])
        after = tp_train(engine2, SAVE_AT, SAVE_AT + MORE)
    elif plan["kind"] == "save_plain":
        cfg = config(plan["stage"], world)
        model = sequential(0)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        before = plain_train(engine, 0, SAVE_AT, rank, world)
        engine.save_checkpoint(plan["ckpt"], client_state={"epoch": 3})
        after = plain_train(engine, SAVE_AT, SAVE_AT + MORE, rank, world)  # without a reload
    else:  # load_universal
        cfg = config(plan["stage"], world, universal=True)
        model = sequential(7)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        engine.load_checkpoint(plan["ckpt"], tag=plan.get("tag"))
        before = []
        after = plain_train(engine, SAVE_AT, SAVE_AT + MORE, rank, world)
    if rank == 0:
        Path(out).write_text(json.dumps({"before": before, "after": after}))


# -- meshspeed side -----------------------------------------------------------------------------
def _ms_rank(rank: int, world: int, port: int, plan: dict, out: str) -> None:
    enter_rank(rank, world, port)
    import torch
    from torch import nn

    import meshspeed
    from meshspeed.pipe import LayerSpec, PipelineModule

    universal = plan.get("load_universal", False)
    if plan["target"] == "tp":
        model = tiny_llama(7)
        engine, *_ = meshspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=tp_config(plan["tp"]))
        _, client = engine.load_checkpoint(plan["ckpt"])
        after = tp_train(engine, SAVE_AT, SAVE_AT + MORE)
    elif plan["target"] == "pipe":
        torch.manual_seed(7)
        net = PipelineModule(layers=layer_list(LayerSpec), num_stages=world, loss_fn=nn.MSELoss(),
                             partition_method="uniform")
        engine, *_ = meshspeed.initialize(model=net, model_parameters=[p for p in net.parameters()],
                                          config=config(plan["stage"], 1, universal, clip=plan.get("clip", 1.0)))
        _, client = engine.load_checkpoint(plan["ckpt"], tag=plan.get("tag"))
        after = pipe_train(engine, SAVE_AT, SAVE_AT + MORE)
    else:
        model = sequential(7)
        engine, *_ = meshspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=config(plan["stage"], world, universal, clip=plan.get("clip", 1.0)))
        _, client = engine.load_checkpoint(plan["ckpt"], tag=plan.get("tag"))
        after = plain_train(engine, SAVE_AT, SAVE_AT + MORE, rank, world)
    if rank == 0:
        Path(out).write_text(json.dumps({"after": after, "global_steps": engine.global_steps,
                                         "client_epoch": (client or {}).get("epoch")}))


def _worker(args) -> None:
    plan = json.loads(Path(args.plan).read_text())
    spawn_ranks(_ds_rank if plan["deepspeed"] else _ms_rank, args.degree, args.plan, args.out)


# -- the parent -----------------------------------------------------------------------------------
def _run(tmp: Path, world: int, plan: dict, name: str) -> dict:
    work = tmp / f"run-{name}"
    work.mkdir(exist_ok=True)
    return run_degree(__file__, world, plan, work)


def ds_pipe(tmp: Path, stage: int) -> tuple[Path, dict]:
    ckpt = tmp / f"ds-pipe-z{stage}"
    return ckpt, _run(tmp, 2, {"deepspeed": True, "kind": "pipe", "stage": stage, "ckpt": str(ckpt)}, ckpt.name)


def ds_universal(tmp: Path, stage: int, dp: int) -> tuple[Path, dict]:
    """DeepSpeed saves a plain ZeRO checkpoint, converts it with ds_to_universal, loads the
    universal tag with checkpoint.load_universal and trains: (universal dir, losses)."""
    ckpt = tmp / f"ds-z{stage}-dp{dp}"
    plain = _run(tmp, dp, {"deepspeed": True, "kind": "save_plain", "stage": stage, "ckpt": str(ckpt)},
                 ckpt.name)
    tag = (ckpt / "latest").read_text().strip()
    uni = tmp / f"ds-z{stage}-dp{dp}-universal"
    uni.mkdir()
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    subprocess.run([str(ANCHOR_PY), "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                    str(ckpt / tag), "--output_folder", str(uni / tag), "--num_extract_workers", "1",
                    "--num_merge_workers", "1", "--inject_missing_state"], check=True, env=env, stdout=subprocess.DEVNULL)
    (uni / "latest_universal").write_text(tag)
    (uni / "latest").write_text(tag)
    got = _run(tmp, dp, {"deepspeed": True, "kind": "load_universal", "stage": stage, "ckpt": str(uni)},
               uni.name)
    return uni, {"after": got["after"], "without_reload": plain["after"], "before": plain["before"],
                 "source": str(ckpt)}


def ms_load(tmp: Path, ckpt: Path, target: str, world: int, stage: int, name: str, **extra) -> dict:
    plan = {"deepspeed": False, "target": target, "stage": stage, "ckpt": str(ckpt), **extra}
    return _run(tmp, world, plan, name)


def rel_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def _row(rows: list, source: str, target: str, ref: list[float], got: list[float]) -> None:
    row = {"deepspeed": source, "meshspeed": target, "ds_losses": ref, "ms_losses": got,
           "max_rel_diff": rel_diff(got, ref)}
    rows.append(row)
    print(f"DeepSpeed {source:>22} -> meshspeed {target:>22}: DS {[f'{x:.7f}' for x in ref]} "
          f"MS {[f'{x:.7f}' for x in got]} max rel {row['max_rel_diff']:.2e}", flush=True)


def main_compare(args) -> None:
    rows: list = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        if "pipe" in args.kinds:
            for stage in (0, 1):
                ckpt, ref = ds_pipe(tmp, stage)
                src = f"pipe pp2 dp1 z{stage} fp32"
                for target, world, ms_stage in [("pipe", 2, stage), ("pipe", 1, stage), ("plain", 1, stage),
                                                ("plain", 2, 1 - stage)]:
                    got = ms_load(tmp, ckpt, target, world, ms_stage, f"ms-{ckpt.name}-{target}{world}-{ms_stage}",
                                  clip=pipe_clip(stage))
                    what = f"pipe pp{world}" if target == "pipe" else f"plain dp{world}"
                    _row(rows, src, f"{what} z{ms_stage}", ref["after"], got["after"])
        if "tp" in args.kinds:
            ckpt = tmp / "ds-tp2-z1"
            ref = _run(tmp, 2, {"deepspeed": True, "kind": "tp", "stage": 1, "ckpt": str(ckpt)}, ckpt.name)
            for tp in (2, 1):
                got = ms_load(tmp, ckpt, "tp", tp, 1, f"ms-{ckpt.name}-tp{tp}", tp=tp)
                _row(rows, "AutoTP tp2 dp1 z1 fp32", f"tp{tp} dp1 z1", ref["after"], got["after"])
        if "universal" in args.kinds:
            for stage in (1, 2):
                uni, ref = ds_universal(tmp, stage, 2)
                src = f"z{stage} dp2 fp32 universal"
                for world, ms_stage, key in [(2, stage, True), (1, 3, True), (2, 0, False)]:
                    got = ms_load(tmp, uni, "plain", world, ms_stage, f"ms-{uni.name}-{world}-{ms_stage}-{key}",
                                  load_universal=key)
                    _row(rows, src, f"plain dp{world} z{ms_stage}{' load_universal' if key else ''}",
                         ref["after"], got["after"])
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


def _copy(ckpt: Path, dest: Path) -> None:
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(ckpt, dest / "ckpt")
    for junk in [*(dest / "ckpt").rglob("zero_to_fp32.py"), *(dest / "ckpt").rglob("zero_to_torch.py")]:
        junk.unlink()  # DeepSpeed's scripts: not ours to commit, not needed


def write_fixtures(args) -> None:
    FIXTURES.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        if "pipe" in args.kinds:
            for stage in (0, 1):
                ckpt, ref = ds_pipe(tmp, stage)
                dest = FIXTURES / f"pipe_pp2_z{stage}"
                _copy(ckpt, dest)
                info = {"ds_losses_after_load": ref["after"], "ds_losses_before_save": ref["before"],
                        "zero_stage": stage, "pp": 2, "dp": 1, "precision": "fp32"}
                (dest / "expected.json").write_text(json.dumps(info, indent=1) + "\n")
                print(f"wrote {dest}", flush=True)
        if "tp" in args.kinds:
            ckpt = tmp / "ds-tp2-z1"
            ref = _run(tmp, 2, {"deepspeed": True, "kind": "tp", "stage": 1, "ckpt": str(ckpt)}, ckpt.name)
            dest = FIXTURES / "autotp_tp2_z1"
            _copy(ckpt, dest)
            info = {"ds_losses_after_load": ref["after"], "ds_losses_before_save": ref["before"],
                    "zero_stage": 1, "tp": 2, "dp": 1, "precision": "fp32"}
            (dest / "expected.json").write_text(json.dumps(info, indent=1) + "\n")
            print(f"wrote {dest}", flush=True)
        if "universal" in args.kinds:
            uni, ref = ds_universal(tmp, 2, 2)
            dest = FIXTURES / "universal_z2_dp2"
            _copy(uni, dest)
            shutil.copytree(ref["source"], dest / "source")  # the ZeRO checkpoint it was made from
            for junk in [*(dest / "source").rglob("zero_to_fp32.py"), *(dest / "source").rglob("zero_to_torch.py")]:
                junk.unlink()
            info = {"ds_losses_after_load": ref["after"], "ds_losses_before_save": ref["before"],
                    "ds_losses_without_reload": ref["without_reload"], "zero_stage": 2, "dp": 2,
                    "precision": "fp32"}
            (dest / "expected.json").write_text(json.dumps(info, indent=1) + "\n")
            print(f"wrote {dest}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--degree", type=int, help=argparse.SUPPRESS)
    p.add_argument("--plan", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--kinds", default="pipe,universal,tp", help="pipe,universal,tp (default all)")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--write-fixtures", action="store_true", help="write the CI fixtures")
    args = p.parse_args()
    if args.worker:
        _worker(args)
    elif args.write_fixtures:
        write_fixtures(args)
    else:
        main_compare(args)


if __name__ == "__main__":
    main()
