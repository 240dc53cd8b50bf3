"""What one set of gloo ranks runs for `long_context.py`: a measured run (step time,
context-parallel bytes, saved activations, RSS growth) or one trial of the memory-cap
search (does one training step at this sequence length fit under the cap?).

Every job is meshspeed's GPT trained by `meshspeed.initialize` on `degree` ranks, dp = 1:
degree 1 is the plain model (no `context_parallel` section), degree P > 1 has
`"context_parallel": {"size": P, "mode": method}` and the engine cuts each (1, S) batch
over the cp ranks. One intra-op thread per rank.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import socket
import statistics
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

METHODS = ("ulysses", "ring", "ring_balanced", "hybrid")
CP_OPS = ("all_to_all", "send", "recv")  # context-parallel traffic
SYNC_OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")  # gradients, loss average
MMAP_THRESHOLD = 128 * 1024  # Note [malloc for memory measurements] in long_context.py
# Note [ranks forked from a preloaded server] in long_context.py
START_METHOD = "forkserver"
PRELOAD = ["torch._dynamo", "long_context_worker", "pipeline_worker", "meshspeed.engine.build", "meshspeed.models.gpt",
           "meshspeed.comm", "meshspeed.sequence.context", "meshspeed.sequence.models", "meshspeed.sequence.data",
           "meshspeed.sequence.ring", "meshspeed.sequence.layer", "meshspeed.sequence.hybrid"]


@dataclass(frozen=True)
class Model:
    n_layer: int = 2  # GPT blocks
    d_model: int = 256  # residual width
    n_head: int = 8  # query heads (head_dim = d_model / n_head)
    n_kv_head: int | None = None  # key/value heads; None: n_head (no grouped-query attention)
    vocab_size: int = 256
    zero_stage: int = 1  # ZeRO stage of the engine (optimizer state sharded over the cp ranks)
    lr: float = 1e-3  # AdamW
    seed: int = 1234  # weights and data

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head


@dataclass(frozen=True)
class Job:
    method: str  # "baseline" at degree 1, else one of METHODS
    degree: int  # ranks = the cp degree (dp = 1)
    seq_len: int  # S, the whole sequence
    model: Model
    comms_timeout: float = 60.0  # the engine's; short, so that a rank left waiting fails


def engine_config(job: Job) -> dict:
    m = job.model
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": m.lr, "weight_decay": 0.01}},
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": m.zero_stage},
        "steps_per_print": 10**9,
        "comms_timeout": job.comms_timeout,
    }
    if job.degree > 1:
        cfg["context_parallel"] = {"size": job.degree, "mode": job.method}
        if job.method == "hybrid":
            cfg["context_parallel"]["ulysses_size"] = 2  # all-to-all in pairs, the ring across them
    return cfg


def build(job: Job):
    import meshspeed
    from meshspeed.models.gpt import GPT, GPTConfig

    m = job.model
    torch.manual_seed(m.seed)
    net = GPT(GPTConfig(vocab_size=m.vocab_size, max_seq_len=job.seq_len, n_layer=m.n_layer, n_head=m.n_head,
                        n_kv_head=m.n_kv_head, d_model=m.d_model))
    engine, *_ = meshspeed.initialize(model=net, model_parameters=net.parameters(), config=engine_config(job))
    return engine


def batch(job: Job, index: int, seq_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, targets), (1, S) each, the same on every rank (the engine cuts them)."""
    s = seq_len or job.seq_len
    g = torch.Generator().manual_seed(job.model.seed + index)
    tokens = torch.randint(0, job.model.vocab_size, (1, s + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def train_step(engine, ids, targets) -> float:
    loss = engine(ids, targets)
    engine.backward(loss)
    engine.step()
    return float(loss.detach())


# -- activation memory (Note [activation memory, measured] in pipeline.py) -------------------


class SavedBytes:
    """Peak bytes of distinct storages held by saved-for-backward tensors (parameters'
    storages excluded): a storage counts from its first pack to its last handle's release."""

    def __init__(self, exclude: set[int]):
        self.exclude, self.handles = exclude, {}  # data_ptr -> [handles, nbytes]
        self.live = self.peak = 0

    def pack(self, t: torch.Tensor) -> _Saved:
        return _Saved(self, t)

    def acquire(self, t: torch.Tensor) -> int | None:
        s = t.untyped_storage()
        key, n = s.data_ptr(), s.nbytes()
        if key in self.exclude or n == 0:
            return None
        entry = self.handles.setdefault(key, [0, n])
        if entry[0] == 0:
            self.live += n
            self.peak = max(self.peak, self.live)
        entry[0] += 1
        return key

    def release(self, key: int | None) -> None:
        if key is not None:
            entry = self.handles[key]
            entry[0] -= 1
            if entry[0] == 0:
                self.live -= self.handles.pop(key)[1]


class _Saved:
    __slots__ = ("key", "tensor", "tracker")

    def __init__(self, tracker: SavedBytes, tensor: torch.Tensor):
        self.tracker, self.tensor, self.key = tracker, tensor, tracker.acquire(tensor)

    def __del__(self):
        self.tracker.release(self.key)


def _statm() -> tuple[int, int]:
    """(resident, data) bytes of this process: /proc/self/statm's RSS and its private
    writable mappings (VmData + stack, what RLIMIT_DATA caps but the stack)."""
    with open("/proc/self/statm") as f:
        fields = f.read().split()
    page = os.sysconf("SC_PAGE_SIZE")
    return int(fields[1]) * page, int(fields[5]) * page


def vm_data() -> int:
    """Bytes of this process's private writable mappings (VmData), what RLIMIT_DATA caps."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmData:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmData in /proc/self/status")


class PeakRSS:
    """The highest RSS (and data size) of this process above its values at start, sampled
    every `period` seconds by a thread."""

    def __init__(self, period: float = 0.002):
        self.period, self._stop = period, threading.Event()

    def __enter__(self):
        gc.collect()
        self.start = self.peak = _statm()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            now = _statm()
            self.peak = (max(self.peak[0], now[0]), max(self.peak[1], now[1]))
            time.sleep(self.period)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    @property
    def growth(self) -> int:
        return self.peak[0] - self.start[0]

    @property
    def data_growth(self) -> int:
        return self.peak[1] - self.start[1]


# -- the ranks ---------------------------------------------------------------------------------


def preload() -> None:
    """Import torch and meshspeed once, in the fork server every set of ranks is forked from
    (call before the first set starts)."""
    import multiprocessing

    multiprocessing.set_forkserver_preload(PRELOAD)


def start(fn, args: tuple, nprocs: int, join: bool = True):
    return mp.start_processes(fn, args=args, nprocs=nprocs, join=join, start_method=START_METHOD)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def set_mmap_threshold(nbytes: int) -> None:
    """glibc's mmap threshold, and the free heap returned to the OS (Note [malloc for memory
    measurements] in long_context.py)."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, nbytes)  # M_MMAP_THRESHOLD
    libc.malloc_trim(0)


def meshspeed_mmap_threshold() -> int:
    from meshspeed.process.malloc import DEFAULT_MMAP_THRESHOLD

    return int(os.environ.get("MESHSPEED_MMAP_THRESHOLD", DEFAULT_MMAP_THRESHOLD))


def memory_step(engine, job: Job, warm_len: int) -> dict:
    """One step at `job.seq_len` right after one at `warm_len` tokens, glibc's mmap threshold
    low: peak saved-for-backward bytes, and peak RSS / data growth of the step."""
    set_mmap_threshold(MMAP_THRESHOLD)
    train_step(engine, *batch(job, 0, warm_len))
    ids, targets = batch(job, 1)
    set_mmap_threshold(MMAP_THRESHOLD)
    dist.barrier()
    tracker = SavedBytes({p.untyped_storage().data_ptr() for p in engine.module.parameters()})
    with PeakRSS() as rss, torch.autograd.graph.saved_tensors_hooks(tracker.pack, lambda h: h.tensor):
        train_step(engine, ids, targets)
    return {"saved_peak_bytes": tracker.peak, "saved_left_bytes": tracker.live, "rss_growth_bytes": rss.growth,
            "data_growth_bytes": rss.data_growth}


def measure(job: Job, warmup: int, steps: int, warm_len: int, wait_idle: float) -> dict:
    """This rank's numbers of one method at one degree. First the memory step (as a trial of
    the search sees it: after one short step); then, with meshspeed's own mmap threshold,
    `warmup` steps, `steps` timed steps (each started at a barrier; before them rank 0 waits
    up to `wait_idle` seconds for the machine to be quiet) and one step whose bytes are
    counted per op in forward, backward and optimizer step."""
    from pipeline_worker import LoadMeter, wait_until_idle

    from meshspeed.comm import CommCounter

    engine = build(job)
    memory = memory_step(engine, job, warm_len)
    set_mmap_threshold(meshspeed_mmap_threshold())
    for i in range(warmup):
        train_step(engine, *batch(job, 2 + i))
    seconds, cpu, losses = [], [], []
    if dist.get_rank() == 0 and wait_idle:
        wait_until_idle(wait_idle)
    meter = LoadMeter()
    meter.start()
    for i in range(steps):
        ids, targets = batch(job, 2 + warmup + i)
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        losses.append(train_step(engine, ids, targets))
        seconds.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    load = meter.stop(dist.all_gather_object)
    ids, targets = batch(job, 2 + warmup + steps)
    dist.barrier()
    comm = {}
    with CommCounter() as counter:
        loss = engine(ids, targets)
    comm["forward"] = counter.summary()
    with CommCounter() as counter:
        engine.backward(loss)
    comm["backward"] = counter.summary()
    with CommCounter() as counter:
        engine.step()
    comm["step"] = counter.summary()
    engine.destroy()
    return {"step_s": seconds, "cpu_s": cpu, "other_load": load, "losses": losses, "comm": comm, **memory}


def measure_rank(rank: int, world: int, port: int, job: Job, warmup: int, steps: int, warm_len: int,
                 wait_idle: float, out_file: str) -> None:
    _init(rank, world, port)
    try:
        got = [None] * world
        dist.all_gather_object(got, measure(job, warmup, steps, warm_len, wait_idle))
        if rank == 0:
            Path(out_file).write_text(json.dumps({"job": asdict(job), "ranks": got}))
    finally:
        dist.destroy_process_group()


def run_measure(job: Job, warmup: int, steps: int, warm_len: int, wait_idle: float = 0.0,
                attempts: int = 2) -> dict:
    """measure() on fresh ranks; a set of ranks that dies (a rank aborted) is started again,
    up to `attempts` times, and the failures are listed in the row."""
    from torch.multiprocessing.spawn import ProcessException

    failures = []
    while True:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "result.json")
            try:
                start(measure_rank, (job.degree, free_port(), job, warmup, steps, warm_len, wait_idle, out),
                      job.degree)
                return {**summarise(json.loads(Path(out).read_text())), "failed_attempts": failures}
            except ProcessException as err:
                failures.append(str(err))
                if len(failures) >= attempts:
                    raise


# -- one trial of the memory-cap search --------------------------------------------------------

OOM_TEXT = ("can't allocate memory", "bad_alloc", "Cannot allocate memory")


def fit_rank(rank: int, world: int, port: int, job: Job, budget: int, warm_len: int, mode: str,
             out_dir: str) -> None:
    """One trial of the search: warm up at `warm_len` tokens, then one step at `job.seq_len`
    under the budget. mode "cap": RLIMIT_DATA at this rank's VmData + `budget` (Note [the
    memory cap] in long_context.py); mode "rss": no cap, the step's sampled RSS growth
    against the budget. Writes rank<r>.json: "fits", "oom" (the allocator refused, or the
    RSS growth was over) or "error"; a failed rank exits at once and the parent ends the
    peers waiting on it."""
    out = Path(out_dir) / f"rank{rank}.json"
    started = time.time()
    _init(rank, world, port)
    inited = time.time()
    engine = build(job)
    built = time.time()
    set_mmap_threshold(MMAP_THRESHOLD)
    train_step(engine, *batch(job, 0, warm_len))
    warmed = time.time()
    ids, targets = batch(job, 1)
    set_mmap_threshold(MMAP_THRESHOLD)
    gc.collect()
    base = vm_data()
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    dist.barrier()
    if mode == "cap":
        resource.setrlimit(resource.RLIMIT_DATA, (base + budget, hard))
    t0 = time.perf_counter()
    detail, growth = "", None
    try:
        with PeakRSS() as rss:
            train_step(engine, ids, targets)
        growth = rss.growth, rss.data_growth
        status = "fits" if mode == "cap" or growth[0] <= budget else "oom"
    except (RuntimeError, MemoryError) as err:
        text = str(err).strip()
        status = "oom" if isinstance(err, MemoryError) or any(t in text for t in OOM_TEXT) else "error"
        detail = text.splitlines()[-1][:300] if text else type(err).__name__
    vm_growth = vm_data() - base
    resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
    out.write_text(json.dumps({"status": status, "detail": detail, "seconds": time.perf_counter() - t0,
                               "setup_s": {"started": started, "init": inited - started, "build": built - inited,
                                           "warm_step": warmed - built},
                               "vm_data_base": base, "vm_data_growth": vm_growth, "rss_growth": growth}))
    if status != "fits":
        os._exit(3)  # the peers may be blocked on this rank: the parent ends them
    dist.barrier()
    dist.destroy_process_group()


def run_trial(job: Job, budget: int, warm_len: int, mode: str, timeout: float, attempts: int = 2) -> dict:
    """One trial in a fresh set of processes: {"status": fits | oom | error | timeout |
    crash, "ranks": [each rank's file, or None], "seconds": wall}; a crash (a rank died
    without a verdict) is tried again, up to `attempts` times."""
    crashes = 0
    while True:
        got = _trial(job, budget, warm_len, mode, timeout)
        if got["status"] != "crash" or crashes + 1 >= attempts:
            return {**got, "crashes_before": crashes}
        crashes += 1


def _trial(job: Job, budget: int, warm_len: int, mode: str, timeout: float) -> dict:
    from torch.multiprocessing.spawn import ProcessException

    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        ctx = start(fit_rank, (job.degree, free_port(), job, budget, warm_len, mode, tmp), job.degree, join=False)
        timed_out = False
        try:
            while not ctx.join(timeout=0.5):
                if time.monotonic() - t0 > timeout:
                    timed_out = True
                    break
        except ProcessException:
            pass  # join has ended the other ranks
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                p.join()
        files = [Path(tmp) / f"rank{r}.json" for r in range(job.degree)]
        ranks = [json.loads(f.read_text()) if f.exists() else None for f in files]
    statuses = {r["status"] for r in ranks if r}
    if "oom" in statuses:
        status = "oom"
    elif "error" in statuses:
        status = "error"
    elif timed_out:
        status = "timeout"
    elif statuses == {"fits"} and all(ranks):
        status = "fits"
    else:
        status = "crash"
    return {"status": status, "ranks": ranks, "seconds": time.monotonic() - t0}


def _cap_probe(budget: int, out_file: str) -> None:
    set_mmap_threshold(MMAP_THRESHOLD)
    base = vm_data()
    resource.setrlimit(resource.RLIMIT_DATA, (base + budget, resource.getrlimit(resource.RLIMIT_DATA)[1]))
    small = torch.ones(budget // 8)  # half the budget: must be allowed
    try:
        big = torch.ones(budget // 2)  # twice the budget: must be refused
        result = f"not refused ({big.numel() * 4} bytes over a {budget}-byte cap)"
    except RuntimeError as err:
        result = "refused" if any(t in str(err) for t in OOM_TEXT) else f"other error: {err}"
    Path(out_file).write_text(json.dumps({"result": result, "small": small.numel()}))


def cap_works(budget: int = 64 * 2**20) -> tuple[bool, str]:
    """Whether RLIMIT_DATA makes torch's allocator refuse here (Note [the memory cap])."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "probe.json")
        p = mp.get_context(START_METHOD).Process(target=_cap_probe, args=(budget, out))
        p.start()
        p.join(60)
        if not Path(out).exists():
            return False, f"the probe process exited {p.exitcode} without an answer"
        result = json.loads(Path(out).read_text())["result"]
    return result == "refused", result


def slowest(ranks: list[dict]) -> list[float]:
    return [max(col) for col in zip(*(r["step_s"] for r in ranks))]


def summarise(data: dict) -> dict:
    """Every rank's raw numbers -> one row: the slowest rank's step times, bytes per phase
    and op per rank, the largest rank's memory."""
    ranks = data["ranks"]
    comm = [{phase: {op: c[op]["bytes"] for op in (*CP_OPS, *SYNC_OPS)} for phase, c in r["comm"].items()}
            for r in ranks]
    per_step = slowest(ranks)
    return {"job": data["job"], "median_step_s": statistics.median(per_step), "step_s": per_step,
            "median_cpu_s": max(statistics.median(r["cpu_s"]) for r in ranks), "other_load": ranks[0]["other_load"],
            "losses": ranks[0]["losses"], "comm_bytes": comm,
            "saved_peak_bytes": max(r["saved_peak_bytes"] for r in ranks),
            "saved_peak_bytes_per_rank": [r["saved_peak_bytes"] for r in ranks],
            "rss_growth_bytes": max(r["rss_growth_bytes"] for r in ranks),
            "rss_growth_bytes_per_rank": [r["rss_growth_bytes"] for r in ranks],
            "data_growth_bytes": max(r["data_growth_bytes"] for r in ranks)}
