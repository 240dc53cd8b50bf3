"""Mixture of Experts: meshspeed's MoE layer beside DeepSpeed 0.19.8's, on the same shapes,
weights and tokens, in one run: tokens/s and the all-to-all share of one training step of
the layer against the expert count and the expert-parallel degree, and dropless routing
against capacity-factor 1.0.

    .venv/bin/python benchmarks/moe.py --json benchmarks/results/moe.json --write-docs
                                                                  # about 11 minutes on 2 cores
    .venv/bin/python benchmarks/moe.py --ep 2 --experts 8 --ks 1 --repeats 3   # a quick look
    .venv/bin/python benchmarks/moe.py --render benchmarks/results/moe.json [--write-docs]   # no run

For each ep in `--ep`, ep gloo ranks on this machine (one intra-op thread each; ep = 1 is
one process, no all-to-all), every rank with `--tokens` tokens of d_model `--d-model` in
fp32, so the total token count grows with ep (weak scaling). For each expert count E in
`--experts` and k in `--ks`, the ranks build four layers with ep_size = ep (the whole world
is the expert-parallel group; E / ep experts per rank), capacity_factor 1.0, min_capacity 4,
noisy_gate_policy None, use_rts and top2_2nd_expert_sampling at their defaults (True):
  DeepSpeed             `deepspeed.moe.layer.MoE`, drop_tokens=True
  meshspeed             `meshspeed.moe.layer.MoE`, drop_tokens=True
  DeepSpeed dropless    drop_tokens=False (DeepSpeed pads every expert to the largest count)
  meshspeed dropless    drop_tokens=False (meshspeed sends the exact tokens, variable splits)
The expert is a two-layer MLP d -> 4d -> d (GELU). All four hold the same weights: the
meshspeed layer is initialised (seed 0 for the gate, the same on every rank; global expert
g drawn from seed 1000 + g, so the experts differ) and its state dict is loaded into the
others (meshspeed keeps DeepSpeed's module tree and keys).

Note [both frameworks in the same ranks]
As in ulysses_ds.py: the machine is shared and its load moves within a minute, so the
ranks hold both frameworks and alternate them call by call. The order is shuffled each
repeat (seeded by the repeat, so the same on every rank): with a fixed cyclic order every
variant would always follow the same other one, whose memory and cache state it inherits,
and that biased the ratios by a few percent either way in trials. They run in the anchor venv (torch 2.13 CPU, DeepSpeed 0.19.8, DS_ACCELERATOR=cpu)
with this checkout on PYTHONPATH for meshspeed. Without that venv only meshspeed runs.

Note [what is timed]
One call is one training step of the layer: forward (gate, dispatch, all-to-all, experts,
all-to-all, combine), the loss sum(out * g) + 0.01 * l_aux with a fixed random g, and the
backward into the tokens (which require grad, as inside a model), the gate and the experts;
started at a barrier, its time is the slowest rank's. Before each call every variant's
generator is reseeded with the same seed (the seed of the repeat), so the random token
selection (k = 1) and the sampled second expert (k = 2) draw the same numbers in both
frameworks and route identically. The table shows the median over `--repeats` calls
after `--warmup` untimed ones; "ratio" is the median over repeats of meshspeed's call over
DeepSpeed's call of the same repeat (paired: the two ran back to back under nearly the
same load), "dropless / cf 1.0" the same pairing of meshspeed's two routings. tokens/s:
ep x `--tokens` / the median step time.

Note [all-to-all share]
`torch.distributed.all_to_all_single`, which both frameworks call for every token
exchange (DeepSpeed through deepspeed.comm's torch backend, meshspeed through
meshspeed.comm), is wrapped in the ranks by a timer that adds up the wall time inside it
(both call it synchronously, so the time is the exchange itself plus any wait for a later
peer; gloo on one machine copies through shared memory). share = the rank-mean of that time
in one call / the call's step time, median over repeats. It counts the 2 forward and 2
backward token exchanges of a capacity step and, in meshspeed's dropless step, also the
small exchange of per-expert counts (E int64 per rank); DeepSpeed's dropless capacity
all-reduce is not an all-to-all and is not counted. The number of wrapped calls per step
is recorded (`a2a_calls`).

At ep = 4 the 2 cores hold 4 ranks (pipeline.py's Note [p = 4 on two cores]): both
frameworks run under the same time sharing, so the ratios still compare them, but the
step times, tokens/s and a2a shares include the scheduler (a rank waiting in an
all-to-all for a peer that is descheduled counts as all-to-all time). "others' load" is
the share of the machine's CPU time that other processes took meanwhile (LoadMeter).

Before timing, each point runs every variant once with the same seed and compares
meshspeed with DeepSpeed (capacity with capacity, dropless with dropless): output, l_aux,
the tokens' gradient and every parameter gradient, largest absolute difference over all
ranks (`parity`).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # siblings, also in spawned ranks

from anchor_ranks import (  # imports no meshspeed
    ANCHOR_PY,
    REPO,
    enter_rank,
    run_degree,
    spawn_ranks,
)
from pipeline_worker import LoadMeter  # imports only torch

DOCS_KEY = "moe.py"
AUX_COEF = 0.01
DS, MS, DS_DL, MS_DL = "DeepSpeed", "meshspeed", "DeepSpeed dropless", "meshspeed dropless"
PAIRS = ((MS, DS), (MS_DL, DS_DL))  # (meshspeed, DeepSpeed) variants that must agree


# -- what the ranks run ------------------------------------------------------------------------------


class A2ATimer:
    """Wraps torch.distributed.all_to_all_single: wall seconds spent inside and calls, since
    the last reset (Note [all-to-all share])."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.seconds, self.calls = 0.0, 0
        inner = dist.all_to_all_single

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += 1

        dist.all_to_all_single = timed

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0


def _expert(d_model: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(d_model, 4 * d_model), torch.nn.GELU(),
                               torch.nn.Linear(4 * d_model, d_model))


def _layers(classes: dict, num_experts: int, k: int, d_model: int, ep: int, ep_rank: int) -> dict:
    """name -> MoE layer: the variants of one point, all with the meshspeed layer's weights."""
    torch.manual_seed(0)
    kwargs = {"num_experts": num_experts, "ep_size": ep, "k": k, "capacity_factor": 1.0, "min_capacity": 4}
    reference = classes[MS](d_model, _expert(d_model), **kwargs)
    local = num_experts // ep
    for i, expert in enumerate(reference.deepspeed_moe.experts.deepspeed_experts):
        g = torch.Generator().manual_seed(1000 + ep_rank * local + i)  # global expert id
        with torch.no_grad():
            for p in expert.parameters():
                p.copy_((torch.rand(p.shape, generator=g) * 2 - 1) / p.shape[-1] ** 0.5)
    state = reference.state_dict()
    layers = {}
    for name, cls in classes.items():
        for dropless in (False, True):
            label = name + (" dropless" if dropless else "")
            layer = reference if label == MS else cls(d_model, _expert(d_model), drop_tokens=not dropless, **kwargs)
            layer.load_state_dict(state)
            layers[label] = layer
    ds_group = None
    for label, layer in layers.items():
        if label.startswith(DS):
            layer.set_deepspeed_parallelism()
            ds_group = layer.deepspeed_moe.ep_group
    if ep > 1:
        import torch.distributed as dist

        group = ds_group if ds_group is not None else dist.group.WORLD  # the same ranks either way
        for label, layer in layers.items():
            if label.startswith(MS):
                layer.set_expert_group(group)
    return {name: layers[name] for name in (DS, MS, DS_DL, MS_DL) if name in layers}


def _inputs(d_model: int, tokens: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7919 * rank + d_model)
    return torch.randn(tokens, d_model, generator=g).requires_grad_(), torch.randn(tokens, d_model, generator=g)


def _step(layer, x: torch.Tensor, upstream: torch.Tensor, seed: int):
    x.grad = None
    layer.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the routing's random draws, the same in every variant
    out, l_aux, _ = layer(x)
    ((out * upstream).sum() + AUX_COEF * l_aux).backward()
    return out, l_aux


def _call(layer, x, upstream, seed: int, timer: A2ATimer) -> tuple[float, float, float, int]:
    """(slowest rank's step seconds, rank-mean a2a seconds, busiest rank's CPU seconds,
    a2a calls on this rank)."""
    import torch.distributed as dist

    dist.barrier()
    timer.reset()
    t0, c0 = time.perf_counter(), time.process_time()
    _step(layer, x, upstream, seed)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    mine = torch.tensor([seconds, timer.seconds, cpu], dtype=torch.float64)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    stacked = torch.stack(gathered)
    return float(stacked[:, 0].max()), float(stacked[:, 1].mean()), float(stacked[:, 2].max()), timer.calls


def _parity(layers: dict, x, upstream) -> dict[str, list[float]]:
    """Per meshspeed variant of PAIRS, against its DeepSpeed variant on this rank:
    [largest |difference| over output, x.grad and parameter grads, the same relative to the
    tensor's largest |value|, 1 if l_aux or exp_counts differ at all else 0]."""
    results = {}
    for name, layer in layers.items():
        out, l_aux = _step(layer, x, upstream, seed=12345)
        tensors = {"out": out.detach().clone(), "x.grad": x.grad.clone()}
        tensors.update((n, p.grad.clone()) for n, p in layer.named_parameters())
        results[name] = (tensors, l_aux.detach().clone(), layer.deepspeed_moe.exp_counts.clone())
    worst = {}
    for ms, ds in PAIRS:
        if ms not in results or ds not in results:
            continue
        (t1, l1, c1), (t2, l2, c2) = results[ms], results[ds]
        assert t1.keys() == t2.keys(), (sorted(t1), sorted(t2))
        diffs = [((t1[n] - t2[n]).abs().max(), t2[n].abs().max()) for n in t1]
        worst[ms] = [max(float(d) for d, _ in diffs), max(float(d / max(m, 1e-30)) for d, m in diffs),
                     float(not (torch.equal(l1, l2) and torch.equal(c1.long(), c2.long())))]
    return worst


def _rank(rank: int, world: int, port: int, plan: dict, out: str) -> None:
    enter_rank(rank, world, port)
    import torch.distributed as dist

    from meshspeed.moe.layer import MoE as Meshspeed

    classes = {MS: Meshspeed}
    if plan["deepspeed"]:
        import deepspeed
        from deepspeed.moe.layer import MoE as Deepspeed
        from deepspeed.utils import logger

        logger.setLevel("WARNING")  # one "Creating MoE layer" line per layer otherwise
        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
        classes = {DS: Deepspeed, **classes}
    else:
        dist.init_process_group("gloo")
    timer = A2ATimer()
    d_model, tokens = plan["d_model"], plan["tokens"]
    x, upstream = _inputs(d_model, tokens, rank)
    rows = []
    for num_experts in plan["experts"]:
        for k in plan["ks"]:
            layers = _layers(classes, num_experts, k, d_model, world, rank)
            worst = _parity(layers, x, upstream)
            parity = {}
            for name, values in worst.items():
                t = torch.tensor(values, dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                parity[name] = {"max_abs": float(t[0]), "max_rel": float(t[1]), "routing_equal": not t[2]}
            variants = list(layers.items())
            seconds = {name: [] for name, _ in variants}
            a2a = {name: [] for name, _ in variants}
            cpu = {name: [] for name, _ in variants}
            calls = {}
            meter = LoadMeter()
            for i in range(plan["warmup"] + plan["repeats"]):
                if i == plan["warmup"]:
                    meter.start()
                order = list(variants)
                random.Random(i).shuffle(order)  # the same order on every rank, Note [both frameworks...]
                for name, layer in order:
                    t, a, c, n = _call(layer, x, upstream, 100 + i, timer)
                    if i >= plan["warmup"]:
                        seconds[name].append(t)
                        a2a[name].append(a)
                        cpu[name].append(c)
                        calls[name] = n
            others = meter.stop(dist.all_gather_object)
            new = [{"ep": world, "experts": num_experts, "k": k, "d_model": d_model, "tokens": tokens,
                    "variant": name, "seconds": seconds[name], "a2a_seconds": a2a[name], "cpu_seconds": cpu[name],
                    "a2a_calls": calls[name], "parity": parity.get(name), "others": others}
                   for name in seconds]
            rows += new
            del layers, variants
            if rank == 0:
                print(f"ep={world} E={num_experts} k={k}: " + ", ".join(
                    f"{r['variant']} {statistics.median(r['seconds']) * 1e3:.1f} ms" for r in new)
                    + f"; others {others:.0%}", flush=True)
    if rank == 0:
        versions = {"torch": torch.__version__}
        if plan["deepspeed"]:
            versions["deepspeed"] = deepspeed.__version__
        Path(out).write_text(json.dumps({"rows": rows, "versions": versions}))
    dist.barrier()
    dist.destroy_process_group()


def worker(world: int, plan_path: str, out: str) -> None:
    spawn_ranks(_rank, world, plan_path, out)


# -- the parent: one launch per ep, the tables ---------------------------------------------------


def _run(world: int, plan: dict, tmp: Path) -> dict:
    return run_degree(__file__, world, plan, tmp)


def _paired(a: list[float] | None, b: list[float] | None) -> float | None:
    if a is None or b is None:
        return None
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def median_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float]:
    """A distribution-free interval for the median: order statistics j and n + 1 - j of
    the n values, j the largest with P(Binomial(n, 1/2) < j) <= (1 - confidence) / 2 (the
    extremes when n is too small for that confidence)."""
    xs, n = sorted(values), len(values)
    j, tail = 0, 0.0
    while j < n // 2:
        tail += math.comb(n, j) / 2**n  # P(B <= j)
        if tail > (1 - confidence) / 2:
            break
        j += 1
    j = max(j, 1)
    return xs[j - 1], xs[n - j]


def _paired_interval(a: list[float] | None, b: list[float] | None) -> list[float] | None:
    if a is None or b is None:
        return None
    return list(median_interval([x / y for x, y in zip(a, b, strict=True)]))


def summarise(rows: list[dict]) -> list[dict]:
    """One entry per (k, E, ep): median ms, tokens/s and a2a share per variant, the paired
    ratios of wall time and of CPU time (Note [what is timed])."""
    points: dict[tuple, dict] = {}
    for r in rows:
        key = (r["k"], r["experts"], r["ep"])
        p = points.setdefault(key, {"k": r["k"], "experts": r["experts"], "ep": r["ep"], "others": r["others"],
                                    "tokens": r["tokens"] * r["ep"], "variants": {}, "seconds": {}, "cpu": {}})
        med = statistics.median(r["seconds"])
        share = statistics.median(a / t for a, t in zip(r["a2a_seconds"], r["seconds"], strict=True))
        p["variants"][r["variant"]] = {
            "ms": med * 1e3, "cpu_ms": statistics.median(r["cpu_seconds"]) * 1e3,
            "tokens_per_s": r["tokens"] * r["ep"] / med, "a2a_share": share,
            "a2a_calls": r["a2a_calls"], "parity": r["parity"]}
        p["seconds"][r["variant"]], p["cpu"][r["variant"]] = r["seconds"], r["cpu_seconds"]
    out = []
    for key in sorted(points):
        p = points[key]
        wall, cpu = p.pop("seconds"), p.pop("cpu")
        p["ratio"] = _paired(wall.get(MS), wall.get(DS))
        p["cpu_ratio"] = _paired(cpu.get(MS), cpu.get(DS))
        p["ratio_dropless"] = _paired(wall.get(MS_DL), wall.get(DS_DL))
        p["cpu_ratio_dropless"] = _paired(cpu.get(MS_DL), cpu.get(DS_DL))
        p["dropless_over_capacity"] = _paired(wall.get(MS_DL), wall.get(MS))
        p["cpu_dropless_over_capacity"] = _paired(cpu.get(MS_DL), cpu.get(MS))
        for field, (m, d) in {"ratio": (MS, DS), "cpu_ratio": (MS, DS), "ratio_dropless": (MS_DL, DS_DL),
                              "dropless_over_capacity": (MS_DL, MS)}.items():
            times = cpu if field.startswith("cpu") else wall
            p[field + "_interval"] = _paired_interval(times.get(m), times.get(d))
        out.append(p)
    return out


def _cell(value, fmt: str, suffix: str = "") -> str:
    return "" if value is None else format(value, fmt) + suffix


def tables(points: list[dict]) -> tuple[list[str], list[str]]:
    """Markdown lines: the capacity-factor 1.0 table, the dropless table."""
    cap = [("| k | E | ep (ranks) | DeepSpeed ms | meshspeed ms | ratio | CPU ratio | DeepSpeed tokens/s "
            "| meshspeed tokens/s | DeepSpeed a2a share | meshspeed a2a share | others' load |"),
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    drop = [("| k | E | ep (ranks) | meshspeed dropless ms | dropless / cf 1.0 | CPU ratio | meshspeed dropless "
             "tokens/s | meshspeed dropless a2a share | DeepSpeed dropless ms | ratio to DeepSpeed dropless "
             "| CPU ratio |"),
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in points:
        v = p["variants"]
        ds, ms, dsd, msd = (v.get(n, {}) for n in (DS, MS, DS_DL, MS_DL))
        head = [str(p["k"]), str(p["experts"]), str(p["ep"])]
        cap.append("| " + " | ".join(head + [
            _cell(ds.get("ms"), ".1f"), _cell(ms.get("ms"), ".1f"), _cell(p["ratio"], ".2f", "x"),
            _cell(p["cpu_ratio"], ".2f", "x"), _cell(ds.get("tokens_per_s"), ",.0f"),
            _cell(ms.get("tokens_per_s"), ",.0f"), _cell(ds.get("a2a_share"), ".0%"),
            _cell(ms.get("a2a_share"), ".0%"), _cell(p["others"], ".0%")]) + " |")
        drop.append("| " + " | ".join(head + [
            _cell(msd.get("ms"), ".1f"), _cell(p["dropless_over_capacity"], ".2f", "x"),
            _cell(p["cpu_dropless_over_capacity"], ".2f", "x"), _cell(msd.get("tokens_per_s"), ",.0f"),
            _cell(msd.get("a2a_share"), ".0%"), _cell(dsd.get("ms"), ".1f"),
            _cell(p["ratio_dropless"], ".2f", "x"), _cell(p["cpu_ratio_dropless"], ".2f", "x")]) + " |")
    return cap, drop


def _verdict(points: list[dict], field: str, target: float, what: str) -> str | None:
    ratios = [(p[field], p) for p in points if p[field] is not None]
    if not ratios:
        return None
    over = [(r, p) for r, p in ratios if r > target]
    worst, at = max(ratios, key=lambda rp: rp[0])
    where = ", ".join(f"k={p['k']} E={p['experts']} ep={p['ep']} {r:.3f}x" for r, p in over)
    line = (f"- {what} (target <= {target:.1f}x): {'met at every point' if not over else 'NOT met'}: "
            f"within target at {len(ratios) - len(over)} of {len(ratios)} points, worst {worst:.3f}x "
            f"(k={at['k']}, E={at['experts']}, ep={at['ep']})" + (f"; over target: {where}" if over else ""))
    if over:
        inside = sum(1 for _, p in over if (p.get(field + "_interval") or [target])[0] <= target)
        line += (f"; at {inside} of these {len(over)} the 95% interval of the median paired ratio still "
                 f"includes {target:.1f}x")
    return line + "."


def verdicts(points: list[dict]) -> list[str]:
    """The issue's two targets point by point, on wall time (the target) and on CPU time."""
    lines = [
        _verdict(points, "ratio", 1.0, "meshspeed / DeepSpeed, capacity factor 1.0, wall time"),
        _verdict(points, "cpu_ratio", 1.0, "meshspeed / DeepSpeed, capacity factor 1.0, CPU time"),
        _verdict(points, "ratio_dropless", 1.0, "meshspeed / DeepSpeed, both dropless, wall time"),
        _verdict(points, "dropless_over_capacity", 1.2, "meshspeed dropless / capacity factor 1.0, wall time"),
    ]
    return [line for line in lines if line]


def _parity_line(points: list[dict]) -> str | None:
    """What the untimed call before each point found (Note [what is timed], last paragraph)."""
    parts, routing = [], []
    for name, label in ((MS, "capacity factor 1.0"), (MS_DL, "dropless")):
        found = [(p, p["variants"][name]["parity"]) for p in points if (p["variants"].get(name) or {}).get("parity")]
        if not found:
            continue
        routing += [par["routing_equal"] for _, par in found]
        exact = [p for p, par in found if par["max_abs"] == 0]
        inexact = [(p, par) for p, par in found if par["max_abs"] != 0]
        text = f"{label}: bit-identical at {len(exact)} of {len(found)} points"
        if inexact:
            where = ", ".join(sorted({f"E={p['experts']} ep={p['ep']}" for p, _ in inexact}))
            text += (f"; at the others ({where}) within {max(par['max_abs'] for _, par in inexact):.1e} "
                     f"({max(par['max_rel'] for _, par in inexact):.1e} of the tensor's largest value)")
        parts.append(text)
    if not parts:
        return None
    return ("meshspeed against DeepSpeed before timing (the same seed, every point, every rank; outputs, the "
            "tokens' gradient and every parameter gradient): " + "; ".join(parts) + ". l_aux and exp_counts "
            + ("identical everywhere" if all(routing) else "NOT identical somewhere (see the JSON)") + ". "
            "A token routed differently would differ by its whole value, so both frameworks keep and drop the "
            "same tokens; the last bits differ where DeepSpeed hands an expert a strided [ep, 1, C, M] view of "
            "its buffer (ep > 1 with several local experts), for which torch's Linear takes other float32 "
            "kernels than for meshspeed's contiguous [ep * C, M] block, and in dropless mode where DeepSpeed's "
            "experts also see the zero rows that pad every expert to the largest count.")


def _span(values: list[float]) -> str:
    low, high = f"{min(values):.0%}", f"{max(values):.0%}"
    return low if low == high else f"{low} to {high}"


def markdown(result: dict) -> str:
    from zero_report import command_and_machine

    plan, points = result["plan"], result["points"]
    cap, drop = tables(points)
    loads = [p["others"] for p in points]
    lines = [
        "## Mixture of Experts beside DeepSpeed 0.19.8's MoE layer (`benchmarks/moe.py`)",
        "",
        (f"One MoE layer's training step (gate, all-to-alls, experts, combine, forward + backward with "
         f"{AUX_COEF} x l_aux in the loss) in both frameworks, the same weights and tokens, in the same gloo "
         f"ranks, alternating call by call (Note [both frameworks in the same ranks]). d_model {plan['d_model']}, "
         f"expert MLP {plan['d_model']} -> {4 * plan['d_model']} -> {plan['d_model']} (GELU), {plan['tokens']} "
         f"tokens per rank, fp32, capacity factor 1.0, min_capacity 4, use_rts and the sampled second expert "
         f"on (both reseeded alike before every call). ep = the number of ranks (the whole world is the "
         f"expert-parallel group, E / ep experts per rank): ep 1 is one process with no all-to-all; ep 4 is "
         f"4 ranks time-shared on 2 cores. Median of {plan['repeats']} calls after {plan['warmup']} warm-up, "
         f"the slowest rank's; ratio = median over repeats of meshspeed's call / DeepSpeed's call of the same "
         f"repeat; CPU ratio the same of the busiest rank's CPU time (steadier where others' load is high); "
         f"tokens/s = ep x {plan['tokens']} / step time; a2a share = time inside `all_to_all_single` (rank "
         f"mean) / step time (Note [all-to-all share]). Others' CPU load during the run: {_span(loads)} of "
         f"the machine. Notes named here are in the script's docstring."),
    ]
    lines += command_and_machine(result["command"], result["machine"])
    lines += ["### Capacity factor 1.0 (drop_tokens=True)", "", *cap, "",
              "### Dropless (drop_tokens=False)", "",
              ("meshspeed sends exactly the routed tokens (variable-size all-to-all, Note [dropless exchange] in "
               "meshspeed/moe/dispatch.py); DeepSpeed pads every expert to the largest expert's count over the "
               "ep group. dropless / cf 1.0: meshspeed's dropless step over its capacity-factor 1.0 step of the "
               "same repeat."), "", *drop, "",
              "### Targets", "", *verdicts(points), ""]
    parity = _parity_line(points)
    if parity:
        lines += [parity, ""]
    if result.get("notes"):
        lines += [result["notes"], ""]
    return "\n".join(lines)


def _plan(args) -> dict:
    return {"experts": args.experts, "ks": args.ks, "d_model": args.d_model, "tokens": args.tokens,
            "warmup": args.warmup, "repeats": args.repeats, "deepspeed": ANCHOR_PY.exists()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ep", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--experts", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=2048, help="per rank")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", type=Path, help="write every timing here")
    parser.add_argument("--write-docs", action="store_true", help="replace the section in docs/benchmarks.md")
    parser.add_argument("--render", type=Path, metavar="JSON", help="no run: the report of a saved --json")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--degree", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--plan", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.degree, args.plan, args.out)
        return
    if args.render:
        result = json.loads(args.render.read_text())
        result["points"] = summarise(result["rows"])  # this checkout's reading of the saved timings
        _report(result, args.write_docs)
        return
    from zero_report import machine_description

    t_start = time.time()
    plan = _plan(args)
    if not plan["deepspeed"]:
        print(f"DeepSpeed skipped: its venv is missing ({ANCHOR_PY}; ../shared/tools/anchor-venv.sh builds it)")
    rows, versions = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for world in args.ep:
            result = _run(world, plan, Path(tmp))
            rows += result["rows"]
            versions = result["versions"]
    machine = machine_description()
    if "deepspeed" in versions:
        machine["deepspeed"] = versions["deepspeed"]
    command = " ".join([".venv/bin/python", "benchmarks/moe.py", *(argv if argv is not None else sys.argv[1:])])
    result = {"command": command, "machine": machine, "plan": plan, "points": summarise(rows), "rows": rows,
              "seconds": round(time.time() - t_start)}
    print(f"done in {result['seconds']} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    _report(result, args.write_docs)


def _report(result: dict, write_docs: bool) -> None:
    section = markdown(result)
    print("\n" + section)
    if write_docs:
        from zero_report import replace_section

        replace_section(section, REPO / "docs" / "benchmarks.md", DOCS_KEY)
        print(f"wrote docs/benchmarks.md ({DOCS_KEY} section)")


if __name__ == "__main__":
    main()
