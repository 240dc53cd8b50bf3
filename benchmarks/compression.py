"""Communication compression side by side: bytes per step and step time (issue 15).

One command trains the reference GPT (`meshspeed.models.gpt.GPT`) on 2 gloo ranks (one
intra-op thread each) with every row below, each in its own pair of fresh rank processes,
and reports per rank and step the bytes `CommCounter` counts (by collective kind), the
median step time on this machine's loopback, and the median step time with a simulated
slow link (`--slow-link MS_PER_MB`, `meshspeed.testing.SlowLink`: each collective also
occupies one link for latency + MB moved x MS_PER_MB, without using the CPU):

    .venv/bin/python benchmarks/compression.py [--quick] [--repeats N] [--write-docs]

Rows: (a) ZeRO stage 3, bf16, on 4 ranks as 2 simulated nodes of 2 (ZeRO++'s setting:
`SlowLink(node_size=2)` slows only collectives whose group spans both nodes): plain,
`zero_quantized_weights` (qwZ), `zero_hpz_partition_size` 2 (hpZ),
`zero_quantized_gradients` (qgZ) and all three. (b) ZeRO stage 0, fp32, on 2 ranks (each
its own node): AdamW, 1-bit Adam (`"type": "OneBitAdam"`, `freeze_step` below the warm-up
so every timed step is compressed) and AdamW with `gradient_compression` int8 and int4.

Note [interleaved timing]
Inside one pair of rank processes the timed steps alternate: one step on the plain
loopback, the next under `SlowLink`, so both columns see the same load. With `--repeats`
the rows are run round-robin (row 1, 2, ..., row 1, 2, ...) and each row keeps its repeat
with the least other load. Every step starts at an untimed barrier; rank 0's wall clock
is the step time; the share of the machine's CPU other processes used meanwhile
(`LoadMeter`-style: busy seconds minus both ranks' CPU seconds) is recorded per run.

Note [how slow a link]
What decides whether fewer bytes pay for the encoding is the ratio of a step's compute to
its transfer time, so the simulated link is scaled as this CPU's compute is. The report
takes the plain stage-3 row's loopback step, about 6 P T floating-point operations per
rank (P parameters, T tokens per rank; attention scores left out), as this machine's
rate R, and an H100's as 400 TFLOP/s (about 40% of its dense bf16 peak). A link of L ms
per MB here then corresponds to (400 TFLOP/s / R) / L GB/s beside an H100. At R ~ 30
GFLOP/s per rank the default 50 ms/MB is ~270 GB/s per GPU: faster than the 50 GB/s of a
400 Gb/s NIC per GPU between nodes, so the default favours the uncompressed rows; 5 ms/MB
(`--slow-link 5`) would be ~2.7 TB/s, faster than NVLink, and shows the loopback
regime.

Note [bytes checked against the docs' formulas]
The bytes of one compressed step are compared with docs/zero.md (qwZ: each plain bf16
unit gather of (N-1)·2S bytes becomes (N-1)·(S + 4·ceil(S/2048))) and docs/compression.md
(1-bit Adam: 2(N-1)/N·P/8 + 8T(N-1); int8/int4: (N-1)·payload(n) per bucket), computed
from the model's parameter sizes and, for qwZ, from the plain run's own per-call gathers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from zero import _busy_seconds, _free_port

REPO = Path(__file__).resolve().parent.parent
AGREEMENT_BYTES = 80  # Note [agreement before each step]: docs/compression.md's tables leave it out
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")

# a group of rows: (ranks, ranks per simulated node)
GROUPS = {"a": (4, 2), "b": (2, 1)}
HPZ = {"zero_hpz_partition_size": GROUPS["a"][1]}
# name -> (group, stage, dtype, config additions)
ROWS: dict[str, tuple[str, int, str, dict]] = {
    "stage3": ("a", 3, "bf16", {}),
    "stage3+qwZ": ("a", 3, "bf16", {"zero_optimization": {"zero_quantized_weights": True}}),
    "stage3+hpZ": ("a", 3, "bf16", {"zero_optimization": HPZ}),
    "stage3+qgZ": ("a", 3, "bf16", {"zero_optimization": {"zero_quantized_gradients": True}}),
    "stage3+qwZ+hpZ+qgZ": ("a", 3, "bf16", {"zero_optimization": {
        "zero_quantized_weights": True, **HPZ, "zero_quantized_gradients": True}}),
    "stage0 AdamW": ("b", 0, "fp32", {}),
    "stage0 OneBitAdam": ("b", 0, "fp32", {"optimizer": "onebit"}),
    "stage0 AdamW+int8": ("b", 0, "fp32", {"gradient_compression": {"method": "int8"}}),
    "stage0 AdamW+int4": ("b", 0, "fp32", {"gradient_compression": {"method": "int4"}}),
}
PLAIN = {"a": "stage3", "b": "stage0 AdamW"}


def world_of(name: str) -> tuple[int, int]:
    return GROUPS[ROWS[name][0]]


def gpt_config(args):
    from meshspeed.models.gpt import GPTConfig

    return GPTConfig(n_layer=args.layers, d_model=args.d_model, n_head=4, max_seq_len=args.seq)


def engine_config(name: str, args) -> dict:
    _group, stage, dtype, extra = ROWS[name]
    lr = 1e-3
    opt = {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.01}}
    if extra.get("optimizer") == "onebit":
        opt = {"type": "OneBitAdam", "params": {"lr": lr, "weight_decay": 0.01, "freeze_step": args.freeze_step}}
    cfg = {
        "train_micro_batch_size_per_gpu": args.micro,
        "gradient_accumulation_steps": 1,
        "optimizer": opt,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {}),
                              **extra.get("zero_optimization", {})},
        "steps_per_print": 10_000,
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if "gradient_compression" in extra:
        cfg["gradient_compression"] = extra["gradient_compression"]
    return cfg


class CallLog:
    """A CommCounter sink keeping every call's (op, bytes, whether its group spans nodes)."""

    def __init__(self, node: int):
        self.node = node
        self.calls: list[tuple[str, int, bool]] = []

    def on_collective(self, op, nbytes, seconds):
        pass

    def on_group(self, op, nbytes, ranks):
        self.calls.append((op, nbytes, len({r // self.node for r in ranks}) > 1))


def rank_main(rank: int, name: str, args, port: int, out_file: str) -> None:
    world, node = world_of(name)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank % node), LOCAL_WORLD_SIZE=str(node))  # qgZ's two hops
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    try:
        import meshspeed
        from meshspeed.comm import counter as cc
        from meshspeed.models.gpt import GPT
        from meshspeed.process.accelerator import _peak_rss_bytes
        from meshspeed.testing.slow_comm import SlowLink

        torch.manual_seed(0)
        model = GPT(gpt_config(args))
        sizes = [p.numel() for p in model.parameters() if p.requires_grad]
        engine, *_ = meshspeed.initialize(model=model, config=engine_config(name, args))
        g = torch.Generator().manual_seed(1234 + rank)
        n = args.warmup + 2 * args.steps
        batches = torch.randint(0, 256, (n, args.micro, args.seq + 1), generator=g)
        link = SlowLink(latency=args.latency_ms / 1e3, seconds_per_mb=args.slow_link / 1e3, node_size=node)
        res = {"fast_s": [], "slow_s": [], "bytes": [], "cross": [], "calls": None, "losses": [], "sizes": sizes,
               "peak_rss": 0}
        for i, x in enumerate(batches):
            timed = i >= args.warmup
            slow = timed and (i - args.warmup) % 2 == 1  # Note [interleaved timing]
            dist.barrier()
            if i == args.warmup:
                busy0, wall0, cpu0 = _busy_seconds(), time.perf_counter(), time.process_time()
            log = CallLog(node)
            cc.attach(log)
            if slow:
                link.__enter__()
            t0 = time.perf_counter()
            loss = engine(x[:, :-1], x[:, 1:])
            engine.backward(loss)
            engine.step()
            elapsed = time.perf_counter() - t0
            if slow:
                link.__exit__(None, None, None)
            cc.detach(log)
            res["losses"].append(float(loss.detach().float()))
            if timed:
                res["slow_s" if slow else "fast_s"].append(elapsed)
                b = dict.fromkeys(KINDS, 0)
                for op, nb, _ in log.calls:
                    b[op] = b.get(op, 0) + nb
                res["bytes"].append(b)
                res["cross"].append(sum(nb for _, nb, cross in log.calls if cross))
                res["calls"] = log.calls
        res["peak_rss"] = _peak_rss_bytes()
        res["param_bytes"] = sum(t.numel() * t.element_size() for t in engine.strategy.memory_tensors()["params"])
        cpu = time.process_time() - cpu0
        cpus = [None] * world
        dist.all_gather_object(cpus, cpu)
        res["other_load"] = max(0.0, (_busy_seconds() - busy0 - sum(cpus)) / ((time.perf_counter() - wall0)
                                                                             * os.cpu_count()))
    except Exception as err:  # noqa: BLE001 - reported in the table
        res = {"unavailable": f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"[:300]}
    gathered = [None] * world
    dist.all_gather_object(gathered, res)
    if rank == 0:
        Path(out_file).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def run_row(name: str, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        try:
            mp.spawn(rank_main, args=(name, args, _free_port(), str(out)), nprocs=world_of(name)[0], join=True)
        except Exception as err:  # noqa: BLE001
            if not out.exists():
                return {"name": name, "unavailable": f"a rank died: {type(err).__name__}"}
        ranks = json.loads(out.read_text())
    if "unavailable" in ranks[0]:
        return {"name": name, "unavailable": ranks[0]["unavailable"]}
    r0 = ranks[0]
    per_rank = [r["bytes"][-1] for r in ranks]
    steady = all(b == r["bytes"][-1] for r in ranks for b in r["bytes"]) and \
        all(c == r["cross"][-1] for r in ranks for c in r["cross"])
    return {
        "name": name,
        "fast_ms": 1e3 * statistics.median(r0["fast_s"]),
        "slow_ms": 1e3 * statistics.median(r0["slow_s"]),
        "bytes": max(per_rank, key=lambda b: sum(b.values())),
        "cross_node": max(r["cross"][-1] for r in ranks),
        "peak_rss": max(r["peak_rss"] for r in ranks),
        "param_bytes": max(r["param_bytes"] for r in ranks),
        "bytes_same_every_step": steady,
        "calls_rank0": r0["calls"],
        "sizes": r0["sizes"],
        "other_load": max(r["other_load"] for r in ranks),
        "first_loss": r0["losses"][0],
        "last_loss": r0["losses"][-1],
    }


# -- formulas (Note [bytes checked against the docs' formulas]) ------------------------------------


def _round4(x: int) -> int:
    return -(-x // 4) * 4


def payload(n: int, method: str, c: int = 256) -> int:
    body = n if method == "int8" else -(-n // 2)
    return _round4(4 * -(-n // c) + body)


def expected(rows: dict[str, dict]) -> dict[str, dict]:
    """Per row: the formula's bytes of the compressed collective, and what was measured."""
    out = {}
    plain_b = rows.get("stage0 AdamW")
    if plain_b and "unavailable" not in plain_b:
        w = GROUPS["b"][0]
        n1 = w - 1
        sizes = plain_b["sizes"]
        n = sum(sizes)
        agree = AGREEMENT_BYTES  # the step agreement's all-reduce, which every row keeps
        out["stage0 AdamW"] = {"what": f"all_reduce, fp32 gradients 2(N-1)/N·4n + the step agreement's {agree} B",
                               "formula": 2 * n1 * 4 * n // w + agree, "measured": plain_b["bytes"]["all_reduce"]}
        for m in ("int8", "int4"):
            r = rows.get(f"stage0 AdamW+{m}")
            if r and "unavailable" not in r:
                out[r["name"]] = {"what": f"all_gather, (N-1)·payload(n), one bucket of {n} elements",
                                  "formula": n1 * payload(n, m), "measured": r["bytes"]["all_gather"]}
        r = rows.get("stage0 OneBitAdam")
        if r and "unavailable" not in r:
            p = sum(-(-s // (8 * w)) * 8 * w for s in sizes)
            t = len(sizes)
            out[r["name"]] = {"what": "all_to_all + all_gather, 2(N-1)/N·P/8 + 8T(N-1)",
                              "formula": 2 * n1 * p // (8 * w) + 8 * t * n1,
                              "measured": r["bytes"]["all_to_all"] + r["bytes"]["all_gather"]}
    plain_a = rows.get("stage3")
    if not plain_a or "unavailable" in plain_a:
        return _equal(out)
    (w, k), n1 = GROUPS["a"], GROUPS["a"][0] - 1
    calls = plain_a["calls_rank0"]
    gathers = [b for op, b, _ in calls if op == "all_gather"]
    shards = [b // (2 * n1) for b in gathers]  # bf16: (N-1)·2S per unit gather
    q = rows.get("stage3+qwZ")
    if q and "unavailable" not in q:
        out["stage3+qwZ"] = {"what": "all_gather, Σ (N-1)·(S + 4·ceil(S/2048)) over the plain run's gathers",
                             "formula": sum(n1 * (s + 4 * -(-s // 2048)) for s in shards),
                             "measured": q["bytes"]["all_gather"]}
    h = rows.get("stage3+hpZ")
    if h and "unavailable" in h:
        h = None
    if h:
        # the same gathers in the same order: forward's over all N, the rest inside the node
        # of K, each moving (K-1)·2S·N/K instead of (N-1)·2S
        got = [(b, cross) for op, b, cross in h["calls_rank0"] if op == "all_gather"]
        local = [s for s, (_, cross) in zip(shards, got) if not cross]
        out["stage3+hpZ"] = {"what": (f"all_gather inside the node, Σ (K-1)·2S·N/K over the gathers after "
                                      f"forward's ({len(local)} of {len(got)}; N {w}, K {k})"),
                             "formula": sum((k - 1) * 2 * s * w // k for s in local),
                             "measured": sum(b for b, cross in got if not cross)}
        out["stage3+hpZ cross-node"] = {"what": "bytes across nodes: plain's minus its backward gathers",
                                        "formula": plain_a["cross_node"] - sum(n1 * 2 * s for s in local),
                                        "measured": h["cross_node"]}
    g = rows.get("stage3+qgZ")
    if g and "unavailable" not in g:
        # plain reduce-scatters fp32 gradients: (N-1)·4S per unit
        rs = [b // (4 * n1) for op, b, _ in calls if op == "reduce_scatter"]
        p = [4 * -(-(4 * -(-s // 256) + -(-s // 2)) // 4) for s in rs]
        nodes = w // k
        out["stage3+qgZ"] = {"what": ("all_to_all in two hops, Σ ((L-1)·G + (G-1))·P over the units, "
                                      f"P = align4(4·ceil(S/256) + ceil(S/2)), L {k} ranks a node, G {nodes} nodes"),
                             "formula": sum(((k - 1) * nodes + nodes - 1) * x for x in p),
                             "measured": g["bytes"]["all_to_all"]}
        out["stage3+qgZ cross-node"] = {"what": "bytes across nodes: plain's with each reduce-scatter's (N-1)·4S "
                                                "replaced by hop 2's (G-1)·P",
                                        "formula": plain_a["cross_node"] - sum(n1 * 4 * s for s in rs)
                                        + sum((nodes - 1) * x for x in p),
                                        "measured": g["cross_node"]}
    return _equal(out)


def _equal(out: dict) -> dict:
    for v in out.values():
        v["equal"] = v["formula"] == v["measured"]
    return out


# -- report ---------------------------------------------------------------------------------------


def pick(runs: list[dict]) -> dict:
    ok = [r for r in runs if "unavailable" not in r]
    if not ok:
        return runs[-1]
    best = dict(min(ok, key=lambda r: r["other_load"]))
    best["runs"] = len(ok)
    return best


def _fmt_bytes(b: int) -> str:
    return f"{b:,}" if b else "0"


def table(rows: list[dict], args) -> str:
    by = {r["name"]: r for r in rows}
    lines = [("| row | ranks (per node) | all_reduce B | all_gather B | reduce_scatter B | all_to_all B "
              "| total B / step / rank | across nodes B | across nodes vs plain | step ms (loopback) | vs plain "
              "| step ms (slow link) | vs plain | resident params B / rank | peak RSS MiB / rank "
              "| loss first → last | other load |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, spec in ROWS.items():
        if name not in by:
            continue
        r = by[name]
        if "unavailable" in r:
            lines.append(f"| {name} | not available: {r['unavailable']} |" + " |" * 15)
            continue
        p = by.get(PLAIN[spec[0]], r)  # a run without the plain row: ratios to itself
        if "unavailable" in p:
            p = r
        w, k = GROUPS[spec[0]]
        tot = sum(r["bytes"].values())
        b = r["bytes"]
        lines.append(
            f"| {name} | {w} ({k}) | {_fmt_bytes(b['all_reduce'])} | {_fmt_bytes(b['all_gather'])} | "
            f"{_fmt_bytes(b['reduce_scatter'])} | {_fmt_bytes(b['all_to_all'])} | {tot:,} | "
            f"{_fmt_bytes(r['cross_node'])} | {r['cross_node'] / p['cross_node']:.3f} | {r['fast_ms']:.0f} | "
            f"{r['fast_ms'] / p['fast_ms']:.2f} | {r['slow_ms']:.0f} | {r['slow_ms'] / p['slow_ms']:.2f} | "
            f"{r['param_bytes']:,} | {r['peak_rss'] / 2**20:.0f} | {r['first_loss']:.3f} → {r['last_loss']:.3f} | "
            f"{r['other_load']:.0%} |")
    return "\n".join(lines)


def targets(rows: list[dict]) -> list[tuple[str, str, bool]]:
    by = {r["name"]: r for r in rows if "unavailable" not in r}
    out = []
    pairs = [(name, PLAIN[spec[0]]) for name, spec in ROWS.items() if name not in PLAIN.values()]
    for name, plain in pairs:
        if name in by and plain in by:
            a, b = by[name]["slow_ms"], by[plain]["slow_ms"]
            saved_mb = (by[plain]["cross_node"] - by[name]["cross_node"]) / 1e6
            extra_ms = by[name]["fast_ms"] - by[plain]["fast_ms"]
            even = (f"; its loopback step is {extra_ms:+.0f} ms and it moves {saved_mb:.2f} MB less across nodes, "
                    f"so it breaks even at about {max(extra_ms, 0) / saved_mb:.0f} ms/MB") if saved_mb > 0 else ""
            out.append((f"slow link: {name} faster than {plain}",
                        f"{a:.0f} vs {b:.0f} ms ({a / b:.2f}){even}", a < b))
    return out


def markdown(rows, checks, args, command, machine, params, wall_s) -> str:
    from zero_report import command_and_machine

    tg = targets(rows)
    ok = [r for r in rows if "unavailable" not in r]
    lines = [
        ("## Communication compression: ZeRO++ (qwZ, hpZ, qgZ), 1-bit Adam, int8/int4 gradients "
         "(`benchmarks/compression.py`)"
         if args.slow_link == parse_args([]).slow_link else
         f"### The same rows on another simulated link: {args.slow_link:g} ms/MB (`--slow-link {args.slow_link:g}`)"),
        "",
        (f"The reference GPT (`meshspeed.models.gpt.GPT`: {args.layers} blocks, d_model {args.d_model}, byte "
         f"vocabulary, {params / 1e6:.2f}M parameters), gloo, one intra-op thread per rank, batch "
         f"{args.micro} x {args.seq} tokens per rank, random tokens. Rows (a): ZeRO stage 3 in bf16 on "
         f"{GROUPS['a'][0]} ranks as {GROUPS['a'][0] // GROUPS['a'][1]} simulated nodes of {GROUPS['a'][1]} "
         "(`stage3_param_persistence_threshold` 0, so every parameter is gathered; gradients reduced in fp32, "
         "the default `communication_data_type`): plain, `zero_quantized_weights` (qwZ), "
         f"`zero_hpz_partition_size` {GROUPS['a'][1]} (hpZ), `zero_quantized_gradients` (qgZ) and all three. "
         f"Rows (b): stage 0 in fp32 on {GROUPS['b'][0]} ranks, each its own node: AdamW (lr 1e-3), `OneBitAdam` "
         f"(`freeze_step` {args.freeze_step}, below the {args.warmup} warm-up steps, so every timed step is "
         "compressed) and AdamW with `gradient_compression` int8 / int4 (chunk 256, error feedback, one "
         "bucket). Each row runs in its own fresh pair of processes: "
         f"{args.warmup} warm-up steps, then {2 * args.steps} timed steps alternating between this "
         "machine's loopback and a simulated slow link between nodes (Note [interleaved timing]): `SlowLink` "
         f"makes every collective whose group spans nodes also occupy the rank's link for {args.latency_ms:g} ms "
         f"+ {args.slow_link:g} ms per MB moved (ring bytes, Note [ring bytes]), without using the CPU, as a "
         "cross-node link would; collectives inside a node run at loopback speed. "
         f"Step time is rank 0's median over {args.steps} steps of each kind; bytes are per step per rank "
         "from `CommCounter` (the largest rank), the same on every timed step"
         f"{'' if all(r.get('bytes_same_every_step', True) for r in rows) else ' (NOT the same on every step for some row)'}. "
         f"Rows were run round-robin {args.repeats} time(s); each keeps its run with the least other load. "
         f"Whole run: {wall_s:.0f} s."),
        *command_and_machine(command, machine),
        table(rows, args),
        "",
        ("Bytes against the formulas of docs/zero.md and docs/compression.md "
        "(Note [bytes checked against the docs' formulas]):"),
        "",
        "| row | collective, formula | formula B | measured B | equal |",
        "|---|---|---|---|---|",
        *[f"| {k} | {v['what']} | {v['formula']:,} | {v['measured']:,} | {'yes' if v['equal'] else '**no**'} |"
          for k, v in checks.items()],
        "",
        "Targets (issue 15):",
        "",
        *[f"- {'met' if ok else '**not met**'}: {what}: {val}" for what, val, ok in tg],
        "",
        link_equivalent(rows, args, params),
        ("- Resident params: the strategy's parameter tensors per rank (the stage-3 shard, plus hpZ's secondary "
         "slot of 1/K of each unit); peak RSS is the process's VmHWM, which the torch runtime dominates at this size."),
        ("- The stage-0 AdamW all-reduce is the fp32 gradient all-reduce plus the step agreement's small "
         "all-reduce (Note [agreement before each step]); the compressed rows keep that small all-reduce."),
        (f"- Other processes used {min(r['other_load'] for r in ok):.0%} to "
         f"{max(r['other_load'] for r in ok):.0%} of this 2-core machine during the kept runs"
         + (", so step times carry tens of ms of noise" if max(r["other_load"] for r in ok) >= 0.1 else "")
         + ("; a slow-link median below the same row's loopback median ("
            + ", ".join(r["name"] for r in ok if r["slow_ms"] < r["fast_ms"]) + ") is run-to-run noise"
            if any(r["slow_ms"] < r["fast_ms"] for r in ok) else "") + "; bytes are exact."),
        ("- On the loopback column the compressed rows pay for encoding and decoding on the same two cores "
         "that compute; the slow-link column is where fewer bytes show."),
        "",
    ]
    return "\n".join(lines)


H100_FLOPS = 400e12  # Note [how slow a link]


def link_equivalent(rows: list[dict], args, params: int) -> str:
    plain = next((r for r in rows if r["name"] == "stage3" and "unavailable" not in r), None)
    if plain is None:
        return "- (no plain stage-3 row: the link is not scaled to an H100, Note [how slow a link])"
    flops = 6 * params * args.micro * args.seq
    rate = flops / (plain["fast_ms"] / 1e3)
    gbs = H100_FLOPS / rate / args.slow_link
    return (f"- How slow the link is (Note [how slow a link]): the plain stage-3 step does about "
            f"{flops / 1e9:.2f} GFLOP per rank in {plain['fast_ms']:.0f} ms, {rate / 1e9:.0f} GFLOP/s; at an H100's "
            f"{H100_FLOPS / 1e12:.0f} TFLOP/s the same compute-to-transfer ratio makes {args.slow_link:g} ms/MB a "
            f"link of about {gbs:,.0f} GB/s per GPU, against 50 GB/s for a 400 Gb/s NIC between nodes and "
            "900 GB/s for NVLink inside one.")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--micro", type=int, default=4, help="sequences per rank per step")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=12)
    ap.add_argument("--steps", type=int, default=6, help="timed steps of each kind (loopback, slow link)")
    ap.add_argument("--freeze-step", type=int, default=10, help="OneBitAdam's freeze_step")
    ap.add_argument("--slow-link", type=float, default=50.0, metavar="MS_PER_MB",
                    help="cross-node link: ms per MB (Note [how slow a link])")
    ap.add_argument("--latency-ms", type=float, default=1.0, help="slow link: latency per collective")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--quick", action="store_true", help="2 timed steps of each kind, one run")
    ap.add_argument("--write-docs", action="store_true",
                    help="replace the section in docs/benchmarks.md and write benchmarks/results/compression.json")
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.quick:
        args.steps, args.repeats = 2, 1
    names = [n for n in args.rows.split(",") if n]
    if args.freeze_step >= args.warmup:
        sys.exit("--freeze-step must be below --warmup so that every timed OneBitAdam step is compressed")
    from meshspeed.models.gpt import GPT

    params = sum(p.numel() for p in GPT(gpt_config(args)).parameters())
    t_start = time.time()
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for rep in range(args.repeats):  # Note [interleaved timing]: rows round-robin
        for name in names:
            t0 = time.time()
            r = run_row(name, args)
            runs[name].append(r)
            got = (f"not available: {r['unavailable']}" if "unavailable" in r else
                   f"{sum(r['bytes'].values()):,} B/step, loopback {r['fast_ms']:.0f} ms, slow link "
                   f"{r['slow_ms']:.0f} ms, other load {r['other_load']:.0%}")
            print(f"[{rep + 1}/{args.repeats}] {name:20s} {got}  [{time.time() - t0:.0f}s]", flush=True)
    wall_s = time.time() - t_start
    rows = [pick(runs[n]) for n in names]
    by = {r["name"]: r for r in rows}
    checks = expected(by)
    print()
    print(table(rows, args))
    for k, v in checks.items():
        print(f"{k}: formula {v['formula']:,} measured {v['measured']:,} {'OK' if v['equal'] else 'DIFFERS'}")
    for what, val, ok in targets(rows):
        print(f"{'met' if ok else 'NOT MET'}: {what}: {val}")
    if args.write_docs:
        from zero_report import machine_description, replace_section

        machine = machine_description()
        command = " ".join([".venv/bin/python", "benchmarks/compression.py",
                            *(argv if argv is not None else sys.argv[1:])])
        section = markdown(rows, checks, args, command, machine, params, wall_s)
        default_link = args.slow_link == parse_args([]).slow_link
        key = "compression.py" if default_link else f"compression.py slow-link-{args.slow_link:g}"
        replace_section(section, REPO / "docs" / "benchmarks.md", key)
        out = REPO / "benchmarks" / "results" / ("compression.json" if default_link
                                                 else f"compression-slow-link-{args.slow_link:g}.json")
        slim = [{k: v for k, v in r.items() if k not in ("calls_rank0", "sizes")} for r in rows]
        out.write_text(json.dumps({"command": command, "machine": machine, "args": vars(args), "params": params,
                                   "wall_s": wall_s, "results": slim, "formula_checks": checks,
                                   "targets": [{"target": t, "measured": v, "met": ok} for t, v, ok in targets(rows)],
                                   "all_runs": {n: [{k: v for k, v in r.items() if k not in ("calls_rank0", "sizes")}
                                                    for r in rs] for n, rs in runs.items()}}, indent=1))
        print(f"wrote docs/benchmarks.md ({key} section) and {out.relative_to(REPO)}")


if __name__ == "__main__":
    main()
