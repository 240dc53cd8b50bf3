"""ZeRO-Infinity side by side: meshspeed and DeepSpeed 0.19 on one GPT, one config.

    PYTHONPATH=. .venv/bin/python benchmarks/infinity_frameworks.py --params 0.3e9 --steps 3 --markdown

Trains the reference GPT of `infinity.py` (`meshspeed.models.gpt.GPT`, about `--params`
parameters, its width and depth from `infinity.gpt_config`) for `--steps` steps on one
fixed batch (world 1, no launcher), once with meshspeed (`import meshspeed as deepspeed`)
and once with DeepSpeed in its own venv (Note [DeepSpeed in its own venv] in zero.py: the
interpreter ../shared/tools/anchor-venv.sh prints, this checkout on PYTHONPATH for the
model file only, DS_ACCELERATOR=cpu). Both get the same DeepSpeed-format config
(`infinity.ds_config`: bf16, ZeRO stage 3, offload_param and offload_optimizer on nvme in
one fresh directory each, the same buffer_count / buffer_size / sub_group_size), plus the
two keys whose defaults differ between the libraries written out: gradient_clipping 0
(DeepSpeed's default is 1.0) and stage3_param_persistence_threshold (meshspeed's default
0, DeepSpeed's 1e5; `--persistence-threshold`). The optimizer is "AdamW": DeepSpeed runs
its JIT-built DeepSpeedCPUAdam for an offloaded optimizer, meshspeed torch's CPU AdamW.

Each framework runs in a fresh process (its own VmHWM, Note [one spawn per framework] in
zero.py), which reports:

- step time: the median of the steps after the first (the first is reported apart);
- peak RSS: VmHWM of the process at the end; `start` is its RSS once torch, the
  framework, the process group and (DeepSpeed) its JIT ops were loaded, before the build;
  phase peaks come from a 20 ms RSS sampler (infinity.RssSampler);
- bytes in the swap directory, walked on disk, after initialize and after the last step,
  and its layout (files and bytes per directory);
- the loss of every step;
- `other load`: the share of the machine's CPU time other processes took while the worker
  ran (from /proc/stat, as zero.py measures it), and the CPU time of each step (all the
  worker's threads): on a shared 2-core machine wall times are approximate, the CPU time
  is the steadier number. `--wait-idle` waits for a quiet machine before each framework.

Note [what DeepSpeed needs here]
ZeRO-Infinity's nvme swapping needs DeepSpeed's async_io op, JIT-built (ninja, g++) against
libaio: without libaio's .so and libaio.h, `deepspeed.zero.Init` with offload_param nvme
raises "RuntimeError: Unable to JIT load the async_io op due to it not being compatible due
to hardware/software issue" and the row says so. On Debian, `apt-get install libaio-dev`;
the first build takes minutes on 2 cores (cached in ~/.cache/torch_extensions afterwards).
The offloaded optimizer is the JIT-built DeepSpeedCPUAdam (cpu_adam op). Both load here, in
the worker, before the RSS baseline (`async_io_load_s`, `cpu_adam_load_s`). DeepSpeed's CPU
accelerator (DS_ACCELERATOR=cpu) runs all of it; no CUDA is involved.

Note [the same initial weights]
meshspeed.zero.Init builds the model bit for bit as the plain build does (Note
[partitioned construction] in meshspeed/parallel/zero/init.py). DeepSpeed's zero.Init
partitions each module at the end of its own __init__, so the GPT's `init_weights`, which
runs at the end of GPT.__init__, writes into DeepSpeed's empty partitioned tensors and
does nothing: DeepSpeed would train torch's default initialisation. So the parent builds
the plain model once (same seed), writes each parameter cast to bf16 to its own file, and
the DeepSpeed worker, after its zero.Init build, loads them one parameter at a time under
`deepspeed.zero.GatheredParameters([p], modifier_rank=0)` (one parameter resident at a
time, before `initialize`, so the masters DeepSpeed makes from the bf16 parameters are the
ones meshspeed makes). meshspeed needs no file.

Note [bytes and busy time, measured alike]
meshspeed counts its own swap bytes (meshspeed.offload.aio.io_totals); DeepSpeed does not,
so neither count is used here. Each worker measures itself from /proc around every step
(disk_meter.py): /proc/self/io read_bytes / write_bytes (every thread of the process: what
it caused the storage layer to read, page-cache hits excluded, and to write, buffered
writes when the page is dirtied), and /proc/diskstats of the block device under the swap
directory: its sectors read and written and its io_ticks, the milliseconds it had a request
in flight. Disk busy = io_ticks delta / the step's wall time. The device columns count
every process on the machine and the kernel's writeback of dirty pages written earlier:
on a shared machine they are an upper bound of the framework's own; /proc/<pid>/io is the
framework's alone. Both frameworks get the same device and the same arithmetic.

Note [the tutorial config]
`--tutorial-config` leaves out of both frameworks' config what the ZeRO-Infinity
tutorial does not write (TUNED: sub_group_size, stage3_max_live_parameters, stage3_prefetch_bucket_size and both
offloads' buffer_count, offload_param.buffer_size), so each library runs on its own
defaults: DeepSpeed's (sub_group_size 1e9, optimizer buffer_count 4, parameter buffers 5 x
1e8) and meshspeed's (chosen from the model and MemAvailable where it does, issue 33).
The persistence threshold and gradient_clipping stay written out
(the same in both).

Note [DeepSpeed at 2B, estimated]
The 2B run is 13+ minutes a framework and DeepSpeed's peak scales past this machine, so it
is estimated, not run: its swappers pin `param buffer_count x buffer_size` bf16 elements
and `optimizer buffer_count x min(sub_group_size, params)` fp32 elements whatever the model,
and the rest of its peak grows with the parameters. From this run: per-param = (peak -
start - those buffers) / params; at 2B, start + buffers(2B) + per-param x 2B. Over 90% of
the machine's memory says "does not fit". It is a linear extrapolation from one size;
two sizes (`--params`) check the slope.

When DeepSpeed cannot run (no venv, its async_io op cannot be built because libaio is
missing, ...), its row says why: the error line of the worker.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

from disk_meter import DiskMeter
from infinity import (
    RssSampler,
    add_run_arguments,
    ds_config,
    gpt_config,
    hwm_bytes,
    rss_bytes,
    swap_bytes,
)

FRAMEWORKS = ("meshspeed", "deepspeed")
GIB = 2**30


# what `--tutorial-config` leaves unset, in both frameworks' config (Note [the tutorial config])
TUNED = {"zero_optimization": ("sub_group_size", "stage3_max_live_parameters", "stage3_prefetch_bucket_size"),
         "zero_optimization.offload_optimizer": ("buffer_count",),
         "zero_optimization.offload_param": ("buffer_count", "buffer_size")}


def config(args, nvme: str) -> dict:
    # the tuned config, with TUNED taken out below (infinity.py's own --tutorial-config
    # writes a shorter dict; both frameworks here must differ only in the library)
    cfg = ds_config(argparse.Namespace(**{**vars(args), "tutorial_config": False}), nvme)
    cfg["gradient_clipping"] = 0.0
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = args.persistence_threshold
    if args.tutorial_config:
        for where, keys in TUNED.items():
            section = cfg
            for part in where.split("."):
                section = section[part]
            for key in keys:
                del section[key]
    return cfg


def swap_layout(root: str) -> dict[str, dict]:
    """Files, bytes and the distinct file sizes under each directory of `root` (relative)."""
    out: dict[str, dict] = {}
    for d, _, files in os.walk(root):
        if not files:
            continue
        sizes = [os.path.getsize(os.path.join(d, f)) for f in files]
        out[os.path.relpath(d, root)] = {"files": len(files), "bytes": sum(sizes),
                                         "distinct_sizes": sorted(set(sizes))[:8],
                                         "example": min(files)}
    return out


# -- the worker: one framework in this process -------------------------------------------------


def _deepspeed_preflight() -> dict:
    """Load (JIT-building on first use) the ops ZeRO-Infinity needs, before the baseline."""
    from deepspeed.ops.op_builder import AsyncIOBuilder, CPUAdamBuilder

    out = {}
    for name, builder in (("async_io", AsyncIOBuilder()), ("cpu_adam", CPUAdamBuilder())):
        t = time.perf_counter()
        compatible = builder.is_compatible(verbose=False)
        try:
            builder.load(verbose=False)  # DeepSpeed's own error when it cannot: that is the row's reason
        except Exception as err:
            hint = " (is_compatible() False: libaio's .so and libaio.h not found; apt-get install libaio-dev)" \
                if name == "async_io" and not compatible else ""
            what = str(err) if isinstance(err, RuntimeError) else f"{type(err).__name__}: {err}"
            raise RuntimeError(what + hint) from err
        out[f"{name}_load_s"] = round(time.perf_counter() - t, 2)
    return out


def _load_weights_deepspeed(model, weights_dir: str) -> None:
    """Note [the same initial weights]: one parameter at a time, gathered and written back."""
    import deepspeed

    for i, (name, p) in enumerate(model.named_parameters()):
        value = torch.load(os.path.join(weights_dir, f"{i}.pt"))
        with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
            if tuple(p.shape) != tuple(value.shape):
                raise RuntimeError(f"{name}: gathered {tuple(p.shape)}, file {tuple(value.shape)}")
            p.data.copy_(value)
        del value


def weights_digest(model, gathered) -> str:
    """sha1 of every parameter's bytes in order (bf16), each made whole by `gathered([p])`."""
    h = hashlib.sha1()
    for _, p in model.named_parameters():
        with gathered([p]):
            h.update(p.detach().to(torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes())
    return h.hexdigest()


def worker(args) -> dict:
    framework = args.worker
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    torch.set_num_threads(args.threads)
    out: dict = {"framework": framework, "torch": torch.__version__, "threads": args.threads}
    if framework == "deepspeed":
        import deepspeed as lib

        out["version"] = lib.__version__
        out["accelerator"] = lib.get_accelerator()._name
        lib.init_distributed(dist_backend="gloo", verbose=False)
        out.update(_deepspeed_preflight())
    else:
        import meshspeed as lib  # import meshspeed as deepspeed
        import meshspeed.engine.build  # (code is not model memory: loaded before the baseline)
        import meshspeed.offload
        from meshspeed.process.distributed import init_distributed

        out["version"] = getattr(lib, "__version__", "?")
        init_distributed()
    from meshspeed.models.gpt import GPT

    nvme = args.swap_dir
    ds_cfg = config(args, nvme)
    cfg = gpt_config(args.params, args.vocab, args.seq)
    out["model"] = vars(cfg).copy()
    g = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, cfg.vocab_size, (args.micro, args.seq + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    gc.collect()
    out["rss_start"] = rss_bytes()
    with RssSampler(args.sample_ms / 1000) as sampler:
        sampler.phase("build")
        t = time.perf_counter()
        torch.manual_seed(args.seed)
        if framework == "deepspeed":
            with lib.zero.Init(config_dict_or_path=ds_cfg):
                model = GPT(cfg)
            sampler.phase("load weights")
            _load_weights_deepspeed(model, args.weights_dir)
        else:
            with lib.zero.Init(dtype=torch.bfloat16, config_dict_or_path=ds_cfg):  # as DeepSpeed's
                model = GPT(cfg)
        out["build_s"] = time.perf_counter() - t
        if args.check_weights:
            out["weights_sha1"] = weights_digest(model, lib.zero.GatheredParameters)
        out["params"] = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
        sampler.phase("initialize")
        t = time.perf_counter()
        engine, *_ = lib.initialize(model=model, model_parameters=model.parameters(), config=ds_cfg)
        out["initialize_s"] = time.perf_counter() - t
        out["swap_bytes_initialized"] = swap_bytes(nvme)
        losses, times, cpu, fwd_bwd, io = [], [], [], [], []
        meter = DiskMeter(nvme)  # Note [bytes and busy time, measured alike]
        out["disk_device"] = meter.device
        for i in range(args.steps):
            before = meter.snapshot()
            t, c = time.perf_counter(), time.process_time()
            sampler.phase(f"step{i}.fwd_bwd")
            loss = engine(x, y)
            engine.backward(loss)
            fwd_bwd.append(time.perf_counter() - t)
            sampler.phase(f"step{i}.optimizer")
            engine.step()
            times.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)  # every thread of the process (I/O threads too)
            io.append(meter.delta(before, meter.snapshot()))
            losses.append(float(loss.detach()))
            busy = io[-1]["busy_fraction"]
            print(f"[{framework}] step {i}: loss {losses[-1]:.4f} {times[-1]:.1f} s "
                  f"rss {rss_bytes() / GIB:.2f} GiB read {io[-1]['read_bytes'] / 1e9:.2f} GB "
                  f"written {io[-1]['write_bytes'] / 1e9:.2f} GB disk busy "
                  f"{'n/a' if busy is None else f'{busy:.0%}'}", file=sys.stderr, flush=True)
        sampler.phase("after")
        out["swap_bytes"] = swap_bytes(nvme)
        out["swap_layout"] = swap_layout(nvme)
        if framework == "meshspeed":
            from meshspeed.offload import close

            close(engine)
    out.update(losses=losses, step_s=times, step_io=io, step_cpu_s=cpu, fwd_bwd_s=fwd_bwd, hwm=hwm_bytes(), sampled_peak=sampler.peak,
               phase_peaks=sampler.peaks)
    return out


def worker_main(args) -> None:
    try:
        result = worker(args)
    except Exception as err:  # noqa: BLE001  (the row must say why: the error line, and where)
        tb = traceback.format_exc()
        line = f"{type(err).__name__}: {err}".strip()
        result = {"framework": args.worker, "error": line, "traceback_tail": tb.strip().splitlines()[-12:]}
        print(tb, file=sys.stderr, flush=True)
    Path(args.worker_out).write_text(json.dumps(result, default=str))


# -- the parent ---------------------------------------------------------------------------------


def write_initial_weights(args, weights_dir: str) -> int:
    """The plain build's parameters, cast to bf16, one file each (Note [the same initial weights])."""
    from meshspeed.models.gpt import GPT

    torch.manual_seed(args.seed)
    model = GPT(gpt_config(args.params, args.vocab, args.seq))
    n = 0
    for i, (_, p) in enumerate(model.named_parameters()):
        torch.save(p.detach().to(torch.bfloat16).clone(), os.path.join(weights_dir, f"{i}.pt"))
        n += p.numel()
    digest = weights_digest(model, lambda ps: contextlib.nullcontext()) if args.check_weights else None
    del model
    gc.collect()
    return n, digest


def _error_line(log: str) -> str:
    """The last line of a log that looks like an exception (`SomethingError: ...`)."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    for ln in reversed(lines):
        body = ln.split("]: ", 1)[-1]  # DeepSpeed prefixes rank lines with "[rank0]: "
        head = body.split(":", 1)[0]
        if ":" in body and (head.endswith(("Error", "Exception")) or head in ("Killed", "Segmentation fault")):
            return body
    return lines[-1] if lines else "(no output)"


def _busy_seconds() -> float:
    from zero import _busy_seconds as busy

    return busy()


def wait_until_idle(max_wait: float) -> float:
    from zero import wait_until_idle as wait

    return wait(max_wait) if max_wait > 0 else 0.0


def _children_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)  # waited-for children (the workers), all threads
    return ru.ru_utime + ru.ru_stime


def run_framework(framework: str, python: str, args, root: str, weights_dir: str | None) -> dict:
    swap_dir = tempfile.mkdtemp(prefix=f"{framework}-swap-", dir=root)
    out_file, log_file = os.path.join(root, f"{framework}.json"), os.path.join(root, f"{framework}.log")
    cmd = [python, str(Path(__file__).resolve()), "--worker", framework, "--worker-out", out_file,
           "--swap-dir", swap_dir, "--weights-dir", weights_dir or "", "--port", str(29500 + os.getpid() % 1000)]
    for k in ("params", "steps", "vocab", "seq", "micro", "lr", "seed", "sub_group_size", "buffer_count",
              "param_buffer_count", "param_buffer_size", "prefetch", "max_live", "persistence_threshold",
              "threads", "sample_ms"):
        cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    if args.check_weights:
        cmd.append("--check-weights")
    if args.tutorial_config:
        cmd.append("--tutorial-config")
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    if framework == "deepspeed":
        env["DS_ACCELERATOR"] = "cpu"
    wait_until_idle(args.wait_idle)
    t, busy0, own0 = time.perf_counter(), _busy_seconds(), _children_cpu_s()
    with open(log_file, "w") as log:
        try:
            rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout,
                                check=False).returncode
        except subprocess.TimeoutExpired:
            rc = f"timeout after {args.timeout} s"
    wall = time.perf_counter() - t
    other = (_busy_seconds() - busy0) - (_children_cpu_s() - own0)  # CPU seconds others took
    text = Path(log_file).read_text(errors="replace")
    if os.path.exists(out_file):
        result = json.loads(Path(out_file).read_text())
    else:  # killed (out of memory?) or crashed before it could write
        result = {"framework": framework, "error": f"worker exited {rc} without results: {_error_line(text)}"}
    result.update(python=python, wall_s=wall, other_load=max(0.0, other / (wall * os.cpu_count())),
                  log_tail=text.strip().splitlines()[-15:])
    if args.keep_logs:
        result["log"] = log_file
    for d, _, files in os.walk(swap_dir, topdown=False):  # leftovers (DeepSpeed does not clean up)
        for f in files:
            os.remove(os.path.join(d, f))
        os.rmdir(d)
    return result


def _gib(n) -> str:
    return f"{n / GIB:.2f} GiB" if isinstance(n, (int, float)) and n >= 0 else "n/a"


def _ratio(a, b) -> str:
    return f"{a / b:.2f}x" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else "n/a"


def summarise(r: dict) -> dict:
    if "error" in r:
        return r
    steps = r["step_s"]
    def later(key):  # the median of the steps after the first
        return statistics.median(r[key][1:] if len(r[key]) > 1 else r[key])

    r["median_step_s"], r["median_cpu_s"], r["median_fwd_bwd_s"] = (later(k) for k in ("step_s", "step_cpu_s",
                                                                                          "fwd_bwd_s"))
    r["first_step_s"] = steps[0]
    io = r["step_io"][1:] if len(r["step_io"]) > 1 else r["step_io"]
    for key in ("read_bytes", "write_bytes", "disk_read_bytes", "disk_write_bytes", "busy_fraction"):
        values = [x.get(key) for x in io]
        r[f"median_{key}"] = statistics.median(values) if values and None not in values else None
    return r


def _gb(n) -> str:
    return f"{n / 1e9:.2f} GB" if isinstance(n, (int, float)) else "n/a"


def _pct(x) -> str:
    return f"{x:.0%}" if isinstance(x, (int, float)) else "n/a"


def config_line(args) -> str:
    if args.tutorial_config:
        tuned = "the ZeRO-Infinity tutorial's config: " + ", ".join(
            f"{w.split('.')[-1]}.{k}" for w, keys in TUNED.items() for k in keys) + " unset (each framework's defaults)"
    else:
        tuned = (f"buffer_count {args.buffer_count}, offload_param buffer_count {args.param_buffer_count} / "
                 f"buffer_size {args.param_buffer_size:.0e}, sub_group_size {args.sub_group_size:.0e}, "
                 f"stage3_max_live_parameters {args.max_live:.0e}")
    return (f"bf16, ZeRO stage 3, offload_param + offload_optimizer on nvme ({tuned}; persistence threshold "
            f"{args.persistence_threshold})")


def ds_estimate(r: dict, args, target: float = 2e9) -> str:
    """Note [DeepSpeed at 2B, estimated]: DeepSpeed's peak at `target` parameters from this run's."""
    z = config(args, "")["zero_optimization"]
    o, p = z["offload_optimizer"], z["offload_param"]
    sgs, obc = z.get("sub_group_size", 1_000_000_000), o.get("buffer_count", 4)
    pbc, pbs = p.get("buffer_count", 5), p.get("buffer_size", 100_000_000)

    def fixed(n):  # the swappers' pinned buffers: bf16 parameter buffers, fp32 optimizer buffers
        return pbc * pbs * 2 + obc * min(sgs, n) * 4

    per_param = (r["hwm"] - r["rss_start"] - fixed(r["params"])) / r["params"]
    peak = r["rss_start"] + fixed(target) + per_param * target
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    verdict = "does not fit" if peak > 0.9 * total else "may fit"
    return (f"DeepSpeed at {target / 1e9:.1f}B parameters, estimated from this run (not run): "
            f"{fixed(target) / GIB:.2f} GiB of swap buffers + {per_param:.1f} B/param x {target / 1e9:.1f}B "
            f"+ {r['rss_start'] / GIB:.2f} GiB start = {peak / GIB:.1f} GiB peak RSS, against this machine's "
            f"{total / GIB:.1f} GiB: {verdict}")


def render_markdown(results: dict[str, dict], args, command: str) -> str:
    ok = {k: r for k, r in results.items() if "error" not in r}
    any_ok = next(iter(ok.values()), {})
    model = any_ok.get("model", {})
    device = any_ok.get("disk_device")
    cols = ["step time (median of steps 2..N)", "of which fwd+bwd", "CPU time / step", "first step",
            "read / step", "written / step", "disk busy", "peak RSS (VmHWM)", "RSS before build",
            "swap dir after init", "swap dir after last step", "losses", "other load"]
    lines = [
        ("The same GPT, weights, batch and DeepSpeed-format config for both frameworks. DeepSpeed runs in its "
         "own venv with `DS_ACCELERATOR=cpu`. Its async I/O op needs libaio: `apt-get install -y libaio-dev`, "
         "then a one-time JIT build of about 5 minutes. Without libaio, DeepSpeed's row reports the error. "
         "Details are in benchmarks/infinity_frameworks.md."),
        "",
        (f"Model: reference GPT, {any_ok.get('params', 0) / 1e6:.1f}M parameters (d_model {model.get('d_model')}, "
         f"{model.get('n_layer')} layers, vocab {args.vocab}), seq {args.seq}, micro-batch {args.micro}, "
         f"{args.steps} steps on one fixed batch, {args.threads} threads; {config_line(args)}."),
        "",
        (f"Bytes and disk time per step, measured alike for both (Note [bytes and busy time, measured alike]): "
         f"read / written are the worker's /proc/<pid>/io read_bytes / write_bytes (every thread; page-cache "
         f"hits are not reads, buffered writes count when dirtied); disk busy is the io_ticks of the device "
         f"under the swap directory (`{device}`, /proc/diskstats) over the step's wall time, whoever kept it "
         f"busy. Medians of steps 2..N."),
        "",
        f"`{command}`",
        "",
        "| framework | " + " | ".join(cols) + " |",
        "|---" * (len(cols) + 1) + "|",
    ]
    for name in FRAMEWORKS:
        r = results.get(name)
        if r is None:
            continue
        label = f"{name} {r.get('version', '')}".strip()
        if "error" in r:
            lines.append(f"| {label} | did not run: `{r['error']}` |" + " |" * (len(cols) - 1))
            continue
        lines.append(f"| {label} | {r['median_step_s']:.1f} s | {r['median_fwd_bwd_s']:.1f} s "
                     f"| {r['median_cpu_s']:.1f} s | {r['first_step_s']:.1f} s | {_gb(r['median_read_bytes'])} "
                     f"| {_gb(r['median_write_bytes'])} | {_pct(r['median_busy_fraction'])} | {_gib(r['hwm'])} "
                     f"| {_gib(r['rss_start'])} | {_gib(r['swap_bytes_initialized'])} | {_gib(r['swap_bytes'])} "
                     f"| {', '.join(f'{v:.4f}' for v in r['losses'])} | {r['other_load']:.0%} |")
    if len(ok) == 2:
        m, d = ok["meshspeed"], ok["deepspeed"]
        keys = ("median_step_s", "median_fwd_bwd_s", "median_cpu_s", "first_step_s", "median_read_bytes",
                "median_write_bytes", "median_busy_fraction", "hwm", "rss_start", "swap_bytes_initialized",
                "swap_bytes")
        lines.append("| meshspeed / DeepSpeed | " + " | ".join(_ratio(m[k], d[k]) for k in keys) + " | | |")
    lines.append("")
    for name, r in ok.items():
        if r.get("median_disk_read_bytes") is not None:
            lines.append(f"- {name}: the device `{device}` moved {_gb(r['median_disk_read_bytes'])} read, "
                         f"{_gb(r['median_disk_write_bytes'])} written per step (median; /proc/diskstats "
                         "sectors, every process and the kernel's writeback included)")
    if "deepspeed" in ok:
        lines.append(f"- {ds_estimate(ok['deepspeed'], args)} (Note [DeepSpeed at 2B, estimated])")
    digests = {k: r["weights_sha1"] for k, r in ok.items() if "weights_sha1" in r}
    if digests:
        if getattr(args, "plain_weights_sha1", None):
            digests = {"plain build": args.plain_weights_sha1, **digests}
        same = "identical" if len(set(digests.values())) == 1 else "DIFFERENT"
        lines.append(f"- initial bf16 weights ({same}): " + ", ".join(f"{k} sha1 {v[:12]}" for k, v in digests.items()))
    for name, r in ok.items():
        phases = ", ".join(f"{k} {v / GIB:.2f}" for k, v in r["phase_peaks"].items())
        extra = ", ".join(f"{k} {r[k]:.1f} s" for k in ("build_s", "initialize_s", "async_io_load_s",
                                                         "cpu_adam_load_s") if k in r)
        lines.append(f"- {name}: phase peaks (GiB) {phases}; {extra}; wall {r['wall_s']:.0f} s")
        for d, v in r["swap_layout"].items():
            sizes = ", ".join(_gib(s) if s >= 2**26 else f"{s / 2**20:.1f} MiB" for s in v["distinct_sizes"])
            lines.append(f"  - swap `{d}/`: {v['files']} files, {_gib(v['bytes'])} (sizes {sizes}; e.g. "
                         f"`{v['example']}`)")
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    add_run_arguments(ap)
    ap.set_defaults(params=0.3e9)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--persistence-threshold", type=int, default=0)
    ap.add_argument("--wait-idle", type=float, default=120, metavar="SECONDS",
                    help="before each framework, wait up to this long for the machine to be <20%% busy")
    ap.add_argument("--check-weights", action="store_true",
                    help="hash every framework's initial bf16 weights (gathered one at a time) and the plain build's")
    ap.add_argument("--timeout", type=float, default=7200, help="seconds per framework")
    ap.add_argument("--deepspeed-python", default=None, metavar="PYTHON",
                    help="interpreter with DeepSpeed (default: the one ../shared/tools/anchor-venv.sh prints)")
    # --tutorial-config comes with infinity.py's run arguments (Note [the tutorial config])
    ap.add_argument("--markdown", action="store_true", help="print the markdown table (else JSON)")
    ap.add_argument("--write-docs", action="store_true",
                    help="replace this run's section of docs/benchmarks.md (refused on uncommitted code) and "
                         "save its results under benchmarks/results/")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--keep-logs", action="store_true", help="keep the workers' logs (their paths in the JSON)")
    # the worker's side
    ap.add_argument("--worker", choices=FRAMEWORKS, help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    ap.add_argument("--swap-dir", help=argparse.SUPPRESS)
    ap.add_argument("--weights-dir", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=29511, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker_main(args)
        return
    import docs_stamp  # lazy: benchmarks/ joins sys.path at the top; the worker needs no git
    from zero import find_deepspeed_python

    commit = docs_stamp.require_committed() if args.write_docs else docs_stamp.begin()
    wanted = [f for f in args.frameworks.split(",") if f]
    results: dict[str, dict] = {}
    root = tempfile.mkdtemp(prefix="infinity-frameworks-", dir=args.nvme_path)
    pythons = {"meshspeed": sys.executable}
    if "deepspeed" in wanted:
        python, why = find_deepspeed_python(args.deepspeed_python)
        if python is None:
            results["deepspeed"] = {"framework": "deepspeed", "error": why}
        else:
            pythons["deepspeed"] = python
    weights_dir, args.plain_weights_sha1 = None, None
    if "deepspeed" in pythons:
        weights_dir = os.path.join(root, "initial-weights")
        os.makedirs(weights_dir)
        n, digest = write_initial_weights(args, weights_dir)
        args.plain_weights_sha1 = digest
        print(f"initial weights: {n / 1e6:.1f}M parameters written for DeepSpeed", file=sys.stderr, flush=True)
    for name in wanted:
        if name in results:
            continue
        print(f"running {name} ({pythons[name]})", file=sys.stderr, flush=True)
        r = summarise(run_framework(name, pythons[name], args, root, weights_dir))
        results[name] = r
        print(f"  {name}: " + (f"FAILED: {r['error']}" if "error" in r else
              f"step {r['median_step_s']:.1f} s (cpu {r['median_cpu_s']:.1f} s), peak RSS {_gib(r['hwm'])}, swap {_gib(r['swap_bytes'])}, "
              f"losses {r['losses']}"), file=sys.stderr, flush=True)
    if weights_dir:
        for f in os.listdir(weights_dir):
            os.remove(os.path.join(weights_dir, f))
        os.rmdir(weights_dir)
    if not args.keep_logs:
        for f in os.listdir(root):
            os.remove(os.path.join(root, f))
        os.rmdir(root)
    command = " ".join(["PYTHONPATH=. .venv/bin/python", "benchmarks/infinity_frameworks.py",
                        *(argv if argv is not None else sys.argv[1:])])
    if args.json:
        Path(args.json).write_text(json.dumps({"command": command, "args": vars(args), "results": results},
                                              indent=1, default=str))
    text = render_markdown(results, args, command)
    if args.markdown:
        print(text)
    else:
        print(json.dumps(results, default=str))
    if args.write_docs:
        write_docs(text, results, args, command, commit)


def write_docs(text: str, results: dict, args, command: str, commit: str) -> None:
    """This run's section of docs/benchmarks.md (the tutorial config's is a section of its own)
    and its results in benchmarks/results/."""
    from zero_report import replace_section  # lazy: benchmarks/ joins sys.path at the top

    key = "infinity_frameworks.py" + (" tutorial-config" if args.tutorial_config else "")
    title = ("## ZeRO-Infinity side by side with DeepSpeed 0.19.8 (`benchmarks/infinity_frameworks.py`"
             + (", the tutorial's config)" if args.tutorial_config else ")"))
    doc = REPO / "docs" / "benchmarks.md"
    main_end, start = "<!-- infinity_frameworks.py:end -->\n", f"<!-- {key}:start -->"
    old = doc.read_text()
    if start not in old and main_end in old:  # a new section goes right after the main one
        doc.write_text(old.replace(main_end, f"{main_end}\n{start}\n<!-- {key}:end -->\n", 1))
    replace_section(f"{title}\n\n{text}", doc, key, measured=commit)
    name = "infinity-frameworks" + ("-tutorial" if args.tutorial_config else "")
    slim = {k: {f: v for f, v in r.items() if f not in ("log_tail", "traceback_tail")} for k, r in results.items()}
    (REPO / "benchmarks" / "results" / f"{name}.json").write_text(
        json.dumps({"command": command, "commit": commit, "args": vars(args), "results": slim}, indent=1,
                   default=str) + "\n")
    print(f"wrote docs/benchmarks.md's {key} section and benchmarks/results/{name}.json", file=sys.stderr)


if __name__ == "__main__":
    main()
