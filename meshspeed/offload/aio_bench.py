"""`meshspeed aio-bench --path DIR`: the swap engine's read and write bandwidth on a disk,
next to a plain sequential baseline on the same disk.

Baseline: one thread, `os.write` / `os.readv` of `--block-size` blocks in order, the way
`dd bs=<block> oflag=direct` moves a file (and `dd` itself when it is installed). Swap
engine: `meshspeed.offload.aio.SwapEngine` with the `aio` settings given, moving the same
bytes as `--request-mb` requests (one request is one sub-group's state key in training).

With `--direct` (the default, and what the engine uses for swap files) both sides use
O_DIRECT, so the page cache plays no part and the disk is measured; `--buffered` measures
through the page cache instead (reads then mostly hit memory). Writes are followed by
fsync on both sides. Each figure is the best of `--repeats`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from meshspeed.offload.aio import _O_DIRECT, SwapEngine, byte_view
from meshspeed.offload.hostmem import ALIGN, host_empty


def add_arguments(parser) -> None:
    parser.add_argument("--path", required=True, help="directory on the disk to measure")
    parser.add_argument("--size-mb", type=int, default=1024, help="bytes moved per run (MiB)")
    parser.add_argument("--request-mb", type=int, default=64, help="swap engine request size (MiB)")
    parser.add_argument("--block-size", type=int, default=1 << 20, help="bytes per I/O call")
    parser.add_argument("--queue-depth", type=int, default=8)
    parser.add_argument("--thread-count", type=int, nargs="+", default=[1, 2, 4],
                        help="swap engine threads to measure")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--direct", dest="direct", action="store_true", default=True)
    mode.add_argument("--buffered", dest="direct", action="store_false")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--report", default=None,
                        help="markdown file to write an 'aio-bench' section into (e.g. docs/benchmarks.md)")


def main(args) -> int:
    if not os.path.isdir(args.path):
        print(f"aio-bench: --path {args.path!r} is not a directory")
        return 2
    direct = args.direct and bool(_O_DIRECT)
    nbytes = args.size_mb << 20
    work = tempfile.mkdtemp(prefix="meshspeed-aio-bench-", dir=args.path)
    try:
        buf = host_empty(nbytes // 4, align=ALIGN).fill_(1.0)
        rows = [("baseline (os.write / os.readv, 1 thread)",
                 *_best(args.repeats, lambda: _baseline(buf, work, args.block_size, direct)))]
        dd = _dd(work, nbytes, args.block_size, direct, args.repeats)
        if dd is not None:
            rows.append(("dd (bs = block size)", *dd))
        for threads in args.thread_count:
            engine = SwapEngine(block_size=args.block_size, queue_depth=args.queue_depth,
                                thread_count=threads, direct=direct)
            rows.append((f"swap engine, {threads} thread(s), queue depth {args.queue_depth}",
                         *_best(args.repeats, lambda e=engine: _engine(e, buf, work, args.request_mb))))
            engine.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = _format(rows, args, direct)
    print(text)
    if args.report:
        write_docs_section(Path(args.report), "aio-bench", text)
    return 0


def _best(repeats: int, run) -> tuple[float, float]:
    results = [run() for _ in range(repeats)]
    return max(r[0] for r in results), max(r[1] for r in results)


def _open(path: str, flags: int, direct: bool) -> int:
    return os.open(path, flags | (_O_DIRECT if direct else 0), 0o600)


def _baseline(buf: torch.Tensor, work: str, block: int, direct: bool) -> tuple[float, float]:
    """(write GB/s, read GB/s) of one file, one thread, sequential blocks."""
    path = os.path.join(work, "baseline")
    view = byte_view(buf)
    t = time.perf_counter()
    fd = _open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, direct)
    for a in range(0, len(view), block):
        os.write(fd, view[a : a + block])
    os.fsync(fd)
    os.close(fd)
    write = len(view) / (time.perf_counter() - t) / 1e9
    t = time.perf_counter()
    fd = _open(path, os.O_RDONLY, direct)
    for a in range(0, len(view), block):
        os.readv(fd, [view[a : a + block]])
    os.close(fd)
    read = len(view) / (time.perf_counter() - t) / 1e9
    os.unlink(path)
    return write, read


def _engine(engine: SwapEngine, buf: torch.Tensor, work: str, request_mb: int) -> tuple[float, float]:
    path = os.path.join(work, "engine")
    step = (request_mb << 20) // 4
    chunks = [(a, buf[a : a + step]) for a in range(0, buf.numel(), step)]
    t = time.perf_counter()
    reqs = [engine.write(c, path, offset=a * 4) for a, c in chunks]
    for r in reqs:
        r.wait()
    fd = os.open(path, os.O_WRONLY)
    os.fsync(fd)
    os.close(fd)
    write = buf.numel() * 4 / (time.perf_counter() - t) / 1e9
    t = time.perf_counter()
    reqs = [engine.read(c, path, offset=a * 4) for a, c in chunks]
    for r in reqs:
        r.wait()
    read = buf.numel() * 4 / (time.perf_counter() - t) / 1e9
    os.unlink(path)
    return write, read


def _dd(work: str, nbytes: int, block: int, direct: bool, repeats: int):
    exe = shutil.which("dd")
    if exe is None:
        return None
    path = os.path.join(work, "dd")
    count = nbytes // block
    best = (0.0, 0.0)
    for _ in range(repeats):
        flag = ["oflag=direct"] if direct else []
        t = time.perf_counter()
        w = subprocess.run([exe, "if=/dev/zero", f"of={path}", f"bs={block}", f"count={count}",
                            "conv=fsync", *flag], capture_output=True, check=False)
        write = nbytes / (time.perf_counter() - t) / 1e9
        flag = ["iflag=direct"] if direct else []
        t = time.perf_counter()
        r = subprocess.run([exe, f"if={path}", "of=/dev/null", f"bs={block}", *flag],
                           capture_output=True, check=False)
        read = nbytes / (time.perf_counter() - t) / 1e9
        if w.returncode or r.returncode:
            return None
        best = (max(best[0], write), max(best[1], read))
    os.unlink(path)
    return best


def _format(rows, args, direct: bool) -> str:
    baselines = [r for r in rows if not r[0].startswith("swap engine")]
    base_w, base_r = max(r[1] for r in baselines), max(r[2] for r in baselines)
    lines = ["## Swap engine (meshspeed aio-bench)", "",
             (f"`meshspeed aio-bench --path {args.path} --size-mb {args.size_mb} --request-mb "
             f"{args.request_mb} --block-size {args.block_size} --queue-depth {args.queue_depth} "
             f"--thread-count {' '.join(map(str, args.thread_count))}"
             f"{'' if direct else ' --buffered'}`: {args.size_mb} MiB per run, "
             f"{'O_DIRECT' if direct else 'page cache'}, best of {args.repeats}; "
             "writes include fsync. The file system under --path: "
             f"{_fs_of(args.path)}."), "",
             "| method | write GB/s | read GB/s | write vs best baseline | read vs best baseline |",
             "|---|---|---|---|---|"]
    for name, w, r in rows:
        lines.append(f"| {name} | {w:.2f} | {r:.2f} | {w / base_w:.0%} | {r / base_r:.0%} |")
    return "\n".join(lines) + "\n"


def _fs_of(path: str) -> str:
    try:
        out = subprocess.run(["df", "-T", path], capture_output=True, text=True,
                             check=False).stdout.splitlines()
        return " ".join(out[1].split()[:2]) if len(out) > 1 else "unknown"
    except OSError:
        return "unknown"


def write_docs_section(path: Path, name: str, text: str) -> None:
    """Replace the section `name` of the markdown file at `path`, keeping every other one
    (the same markers as the other benchmarks: `<!-- name:start -->` ... `:end -->`)."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    block = f"{start}\n{text.rstrip()}\n{end}\n"
    old = path.read_text() if path.exists() else "# Benchmarks\n"
    if start in old and end in old:
        head, rest = old.split(start, 1)
        new = head + block + rest.split(end, 1)[1].lstrip("\n")
    else:
        new = old.rstrip("\n") + "\n\n" + block
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(new)
