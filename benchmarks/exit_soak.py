"""Short 2-rank training runs, back to back, counting the ones that do not exit cleanly
(issue 9 case 7: `terminate called without an active exception`, SIGABRT after training
succeeded, about 1 run in 40).

    .venv/bin/python benchmarks/exit_soak.py --runs 100
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

TRAIN = '''
import torch, meshspeed
from meshspeed.models.gpt import GPTConfig
from meshspeed.testing.engines import small_engine, train_step
meshspeed.init_distributed()
torch.set_num_threads(1)
cfg = GPTConfig(vocab_size=16, max_seq_len=SEQ, n_layer=1, n_head=2, d_model=8)
engine = small_engine(STAGE, cfg=cfg, **EXTRA)
for _ in range(3):
    train_step(engine, torch.randint(0, 16, (1, SEQ)))
if SAVE:
    engine.save_checkpoint(SAVE_DIR)  # async with --save async: the exit waits for it
print("TRAINED", flush=True)
'''


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--save", choices=["none", "sync", "async"], default="none",
                    help="save a checkpoint at the end of each run (the path where the abort was seen)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (2 ranks: tp 2 = pure tp)")
    ap.add_argument("--sp", action="store_true", help="with --tp: sequence parallelism")
    ap.add_argument("--overlap", action="store_true", help="with --tp: tp_overlap_comm (2 chunks)")
    args = ap.parse_args()
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(repo), "PYTHONFAULTHANDLER": "1"}
    bad = []
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "train.py"
        extra = {"checkpoint": {"async_save": True}} if args.save == "async" else {}
        if args.tp > 1:
            extra["tensor_parallel"] = {"autotp_size": args.tp, "sequence_parallel": args.sp,
                                        "tp_overlap_comm": args.overlap, "overlap_chunks": 2}
        script.write_text(TRAIN.replace("STAGE", str(args.stage)).replace("EXTRA", repr(extra))
                          .replace("SEQ", "8" if args.tp > 1 else "4")
                          .replace("SAVE_DIR", repr(str(Path(tmp) / "ckpt")))
                          .replace("SAVE", str(args.save != "none")))
        for i in range(args.runs):
            proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                   "--master-port", str(_port()), str(script)], check=False,
                                  capture_output=True, text=True, env=env, timeout=300)
            out = proc.stdout + proc.stderr
            if proc.returncode != 0 or out.count("TRAINED") != 2:
                kind = "terminate called" if "terminate called" in out else f"exit {proc.returncode}"
                bad.append((i, kind))
                print(f"run {i}: {kind}\n" + out[-3000:], flush=True)
    print(f"{args.runs - len(bad)} of {args.runs} runs exited cleanly; failures: {bad}")


if __name__ == "__main__":
    main()
