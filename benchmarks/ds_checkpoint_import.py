"""DeepSpeed checkpoints loaded in meshspeed: the losses after loading, on both sides.

For each case (ZeRO stage, data-parallel size, precision) DeepSpeed 0.19.8 (the anchor
venv) trains a tiny MLP for 2 steps, saves, and a fresh DeepSpeed engine loads the
checkpoint and trains 3 more steps: the reference losses. Then meshspeed loads the same
directory at dp 1 and 2 and at the same and another ZeRO stage, and trains the same 3
steps on the same fixed batches (one global batch of 4 rows per step, split over the dp
ranks). Prints both loss lists and the largest relative difference.

    PYTHONPATH=. .venv/bin/python benchmarks/ds_checkpoint_import.py [--quick] [--json out.json]
    PYTHONPATH=. .venv/bin/python benchmarks/ds_checkpoint_import.py --write-fixtures

`--write-fixtures` writes tests/checkpoint/fixtures/deepspeed/: a few tiny DeepSpeed
checkpoints (made by DeepSpeed here) with, next to each, what meshspeed must read from
them (`expected.safetensors`: the fp32 masters, Adam moments and buffers DeepSpeed
saved, gathered; `expected.json`: steps, scheduler, counters, client_state and
DeepSpeed's losses for the 3 steps after loading), so CI checks the reading without
DeepSpeed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from anchor_ranks import REPO, enter_rank, run_degree, spawn_ranks

GLOBAL_ROWS = 4
SAVE_AT = 2
MORE = 3
FIXTURES = REPO / "tests" / "checkpoint" / "fixtures" / "deepspeed"


def build_model(seed: int = 0):
    import torch
    from torch import nn

    class TinyMLP(nn.Module):
        """6 -> 10 -> 3 with a persistent buffer; numels 60, 10, 30, 3 (odd: ZeRO pads)."""

        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(6, 10)
            self.fc2 = nn.Linear(10, 3)
            self.register_buffer("shift", torch.linspace(-0.5, 0.5, 3))

        def forward(self, x, y):
            h = torch.tanh(self.fc1(x.to(self.fc1.weight.dtype)))
            out = self.fc2(h).float() + self.shift.float()
            return torch.nn.functional.mse_loss(out, y.float())

    torch.manual_seed(seed)
    return TinyMLP()


def batches():
    import torch

    g = torch.Generator().manual_seed(1234)
    steps = SAVE_AT + MORE
    return torch.randn(steps, GLOBAL_ROWS, 6, generator=g), torch.randn(steps, GLOBAL_ROWS, 3, generator=g)


def ds_config(stage: int, dp: int, precision: str, torch_adam: bool = False) -> dict:
    cfg = {
        "train_batch_size": GLOBAL_ROWS,
        "train_micro_batch_size_per_gpu": GLOBAL_ROWS // dp,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "betas": [0.9, 0.99], "eps": 1e-6,
                                                 **({"torch_adam": True} if torch_adam else {})}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                     "warmup_num_steps": 10}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        # said explicitly: DeepSpeed 0.19.3+ clips at 1.0 when the key is missing, meshspeed
        # keeps the older default 0 (meshspeed/config/root.py)
        "gradient_clipping": 1.0,
        "steps_per_print": 10_000,
    }
    if precision in ("bf16", "fp16"):
        cfg[precision] = {"enabled": True}
    if precision == "fp16":
        # 2^17: ZeRO overflows on the first step (hysteresis 2 -> 1), so the saved scaler is mid-
        # hysteresis and overflows again after the load; FusedAdam-less stage 0 grows instead
        cfg["fp16"].update({"initial_scale_power": 17, "loss_scale_window": 2, "hysteresis": 2})
    return cfg


def train(engine, first: int, last: int, rank: int, dp: int, scales: list[float] | None = None) -> list[float]:
    """Steps [first, last): this rank's rows of each global batch; the global mean loss.
    `scales` gets the loss scale after each step (fp16)."""
    import torch
    import torch.distributed as dist

    xs, ys = batches()
    micro = GLOBAL_ROWS // dp
    rows = slice(rank * micro, (rank + 1) * micro)
    losses = []
    for step in range(first, last):
        loss = engine(xs[step][rows], ys[step][rows])
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().reshape(1).clone()
        dist.all_reduce(total)
        losses.append(total.item() / dp)
        if scales is not None:
            scales.append(loss_scale(engine))
    del torch
    return losses


def loss_scale(engine) -> float:
    """The current loss scale, on either side."""
    if hasattr(engine, "loss_scaler"):  # meshspeed
        return float(engine.loss_scaler.scale)
    opt = engine.optimizer  # DeepSpeed: ZeRO keeps a LossScaler object, FP16_Optimizer a config
    scaler = getattr(opt, "loss_scaler", None) or getattr(opt, "loss_scale_config", None)
    return float(scaler.cur_scale)


def allow_fp16_on_cpu() -> None:
    """DeepSpeed 0.19.8's CPU accelerator says it has no fp16 and `initialize` refuses an fp16
    config ("Type fp16 is not supported on your device"), though torch computes in fp16 on
    CPU. This benchmark turns that capability check on so DeepSpeed writes real fp16
    checkpoints (ZeRO 0-3) here; nothing else of DeepSpeed's is changed."""
    from deepspeed.accelerator import get_accelerator

    type(get_accelerator()).is_fp16_supported = lambda self: True


# -- DeepSpeed side (anchor venv) ---------------------------------------------------------------
def _ds_rank(rank: int, world: int, port: int, plan: dict, out: str) -> None:
    enter_rank(rank, world, port)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    result = ds_save_and_resume(rank, world, plan)
    if rank == 0:
        Path(out).write_text(json.dumps(result))


def ds_save_and_resume(rank: int, world: int, plan: dict) -> dict:
    """DeepSpeed (process group up) trains SAVE_AT steps, saves to plan["ckpt"], loads it into a
    fresh engine and trains MORE steps: {"before": losses, "after": losses, loss scales}."""
    import deepspeed
    import torch

    if plan["precision"] == "fp16":
        allow_fp16_on_cpu()
    cfg = ds_config(plan["stage"], world, plan["precision"], plan.get("torch_adam", False))
    model = build_model(0)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    scales_before: list[float] = []
    before = train(engine, 0, SAVE_AT, rank, world, scales_before)
    client = {"epoch": 3, "note": "from deepspeed", "offsets": torch.arange(4)}
    engine.save_checkpoint(plan["ckpt"], client_state=client)
    # what was saved, gathered (after a load DeepSpeed 0.19.8's ZeRO 1/2 fragment maps are unset)
    expected = _ds_expected(engine, client) if plan.get("expected") else None
    fresh = build_model(7)
    engine2, *_ = deepspeed.initialize(model=fresh, model_parameters=fresh.parameters(), config=cfg)
    engine2.load_checkpoint(plan["ckpt"])
    loaded_scale = loss_scale(engine2)
    scales: list[float] = []
    after = train(engine2, SAVE_AT, SAVE_AT + MORE, rank, world, scales)
    if expected is not None and rank == 0:
        torch.save(expected, plan["expected"])  # read back by the parent (anchor-made, trusted)
    return {"before": before, "after": after, "scales_before": scales_before,
            "loaded_scale": loaded_scale, "scales": scales}


def _ds_expected(engine, client) -> dict:
    """What DeepSpeed saved, gathered: fp32 masters, moments, step, buffers, counters."""
    import torch
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    tensors, steps = {}, 0
    opt = engine.optimizer
    inner = getattr(opt, "optimizer", opt)
    flat_of = {}  # stage 0 with bf16/fp16: DeepSpeed's FP16_Optimizer keeps one flat fp32 group
    for i, group in enumerate(opt.fp16_groups if hasattr(opt, "fp32_groups_flat") else []):
        offset = 0
        for p in group:
            flat_of[id(p)] = (opt.fp32_groups_flat[i], offset)
            offset += p.numel()
    for name, p in engine.module.named_parameters():
        if id(p) in flat_of:
            flat, offset = flat_of[id(p)]
            for key, t in (("master", flat), ("optim/exp_avg", inner.state[flat]["exp_avg"]),
                           ("optim/exp_avg_sq", inner.state[flat]["exp_avg_sq"])):
                tensors[f"{key}/{name}"] = t.detach()[offset:offset + p.numel()].reshape(p.shape).float().clone()
            continue
        master = safe_get_full_fp32_param(p)
        plain = master is None  # no ZeRO or mixed-precision wrapper: the parameter is the master
        master = p if plain else master
        tensors[f"master/{name}"] = master.detach().float().cpu().clone()
        for key in ("exp_avg", "exp_avg_sq"):
            value = inner.state[p][key] if plain else safe_get_full_optimizer_state(p, key)
            tensors[f"optim/{key}/{name}"] = value.detach().float().cpu().clone()
    for name, b in engine.module.named_buffers():
        tensors[f"buffer/{name}"] = b.detach().float().cpu().clone()
    for st in inner.state.values():  # ZeRO-3 empties its param groups between steps: every state
        if "step" in st:
            steps = max(steps, int(st["step"].item() if torch.is_tensor(st["step"]) else st["step"]))
    sched = engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None
    held = getattr(opt, "loss_scaler", None)  # ZeRO's scaler object (fp16: the dynamic one)
    scaler = {k: v for k, v in vars(held).items() if isinstance(v, (bool, int, float))} if held is not None else None
    return {"tensors": tensors, "info": {
        "loss_scaler": scaler,
        "step": steps, "lr_scheduler": sched, "global_steps": engine.global_steps,
        "global_samples": engine.global_samples, "skipped_steps": engine.skipped_steps,
        "lr": [g["lr"] for g in opt.param_groups],
        "client_state": {k: (v.tolist() if torch.is_tensor(v) else v) for k, v in client.items()
                         if k in ("epoch", "note", "offsets")}}}


# -- meshspeed side -----------------------------------------------------------------------------
def _ms_rank(rank: int, world: int, port: int, plan: dict, out: str) -> None:
    enter_rank(rank, world, port)
    result = ms_resume(rank, world, plan)
    if rank == 0:
        Path(out).write_text(json.dumps(result))


def ms_resume(rank: int, world: int, plan: dict) -> dict:
    """meshspeed loads plan["ckpt"] (DeepSpeed's files) into a fresh engine and trains MORE steps."""
    import meshspeed

    cfg = ds_config(plan["stage"], world, plan["precision"], plan.get("torch_adam", False))
    model = build_model(7)
    engine, *_ = meshspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    _, client = engine.load_checkpoint(plan["ckpt"])
    loaded_scale = loss_scale(engine)
    scales: list[float] = []
    after = train(engine, SAVE_AT, SAVE_AT + MORE, rank, world, scales)
    return {"after": after, "global_steps": engine.global_steps, "loaded_scale": loaded_scale,
            "scales": scales, "client_epoch": client.get("epoch")}


def _worker(args) -> None:
    plan = json.loads(Path(args.plan).read_text())
    fn = _ds_rank if plan["deepspeed"] else _ms_rank
    spawn_ranks(fn, args.degree, args.plan, args.out)


# -- the parent -----------------------------------------------------------------------------------
def ds_save(tmp: Path, stage: int, dp: int, precision: str, expected: str | None = None,
            torch_adam: bool = False) -> tuple[Path, dict]:
    ckpt = tmp / f"ds-z{stage}-dp{dp}-{precision}"
    plan = {"deepspeed": True, "stage": stage, "precision": precision, "ckpt": str(ckpt),
            "expected": expected, "torch_adam": torch_adam}
    work = tmp / f"run-{ckpt.name}"
    work.mkdir(exist_ok=True)
    return ckpt, run_degree(__file__, dp, plan, work)


def ms_load(tmp: Path, ckpt: Path, stage: int, dp: int, precision: str, torch_adam: bool = False) -> dict:
    plan = {"deepspeed": False, "stage": stage, "precision": precision, "ckpt": str(ckpt),
            "torch_adam": torch_adam}
    work = tmp / f"run-ms-{ckpt.name}-z{stage}-dp{dp}"
    work.mkdir(exist_ok=True)
    return run_degree(__file__, dp, plan, work)


def rel_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


CASES = [  # (stage, dp, precision) saved by DeepSpeed
    (0, 1, "fp32"), (0, 2, "fp32"), (1, 2, "fp32"), (2, 1, "fp32"), (2, 2, "fp32"),
    (3, 1, "fp32"), (3, 2, "fp32"), (2, 2, "bf16"), (0, 1, "bf16"), (3, 2, "bf16"),
    (2, 1, "fp16"), (1, 2, "fp16"), (3, 2, "fp16"),
]


def main_compare(args) -> None:
    cases = CASES[:3] if args.quick else CASES
    rows = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for stage, dp, precision in cases:
            ckpt, ref = ds_save(tmp, stage, dp, precision, torch_adam=args.torch_adam)
            for ms_dp, ms_stage in [(dp, stage), (3 - dp, (stage + 1) % 4)]:
                got = ms_load(tmp, ckpt, ms_stage, ms_dp, precision, torch_adam=args.torch_adam)
                row = {"deepspeed": f"z{stage} dp{dp} {precision}", "meshspeed": f"z{ms_stage} dp{ms_dp}",
                       "torch_adam": args.torch_adam,
                       "ds_losses": ref["after"], "ms_losses": got["after"],
                       "max_rel_diff": rel_diff(got["after"], ref["after"])}
                rows.append(row)
                print(f"DeepSpeed {row['deepspeed']:>14} -> meshspeed {row['meshspeed']:>8}: "
                      f"DS {[f'{x:.7f}' for x in ref['after']]} MS {[f'{x:.7f}' for x in got['after']]} "
                      f"max rel {row['max_rel_diff']:.2e}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


FIXTURE_CASES = [(0, 1, "fp32"), (1, 2, "fp32"), (2, 2, "bf16"), (3, 2, "fp32"), (0, 1, "bf16"), (2, 1, "fp16")]


def write_fixtures(args) -> None:
    import torch
    from safetensors.torch import save_file

    FIXTURES.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for stage, dp, precision in FIXTURE_CASES:
            if args.only and f"z{stage}_dp{dp}_{precision}" not in args.only.split(","):
                continue
            exp_path = tmp / f"expected-{stage}-{dp}-{precision}.pt"
            ckpt, ref = ds_save(tmp, stage, dp, precision, expected=str(exp_path))
            name = f"z{stage}_dp{dp}_{precision}"
            dest = FIXTURES / name
            shutil.rmtree(dest, ignore_errors=True)
            shutil.copytree(ckpt, dest / "ckpt")
            for junk in [*(dest / "ckpt").rglob("zero_to_fp32.py"), *(dest / "ckpt").rglob("zero_to_torch.py")]:
                junk.unlink()  # DeepSpeed's scripts: not ours to commit, not needed
            expected = torch.load(exp_path, weights_only=False)
            save_file({k: v.contiguous() for k, v in expected["tensors"].items()},
                      str(dest / "expected.safetensors"))
            info = {**expected["info"], "ds_losses_after_load": ref["after"],
                    "ds_scale_after_load": ref["loaded_scale"], "ds_scales_after_load": ref["scales"],
                    "ds_losses_before_save": ref["before"], "zero_stage": stage, "dp": dp,
                    "precision": precision}
            (dest / "expected.json").write_text(json.dumps(info, indent=1) + "\n")
            print(f"wrote {dest}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--degree", type=int, help=argparse.SUPPRESS)
    p.add_argument("--plan", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true", help="the first three cases only")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--torch-adam", action="store_true",
                   help='optimizer.params.torch_adam: DeepSpeed steps with torch.optim.AdamW, not its '
                        'CPU FusedAdam kernel')
    p.add_argument("--write-fixtures", action="store_true", help="write the CI fixtures")
    p.add_argument("--only", help="with --write-fixtures: these cases only (z3_dp2_fp32,...)")
    args = p.parse_args()
    if args.worker:
        _worker(args)
    elif args.write_fixtures:
        write_fixtures(args)
    else:
        main_compare(args)


if __name__ == "__main__":
    main()
