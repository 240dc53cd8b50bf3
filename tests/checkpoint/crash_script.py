"""Run by test_crash.py under torchrun (2 ranks): save once, then freeze inside a second save.

    python -m torch.distributed.run --standalone --nproc-per-node 2 crash_script.py SAVE_DIR FLAGS STAGE

Each rank freezes after writing its tensor file of the second save (before its marker),
writes FLAGS/rank<R>.pid and sleeps, so the test can SIGKILL a rank mid-save.
"""

import os
import sys
import time

from meshspeed.checkpoint import writer
from tests.checkpoint.workers import make_engine, setup_for, train


def hold(point: str) -> None:
    if point != "rank_file_written":
        return
    rank = os.environ["RANK"]
    tmp = os.path.join(FLAGS, f".rank{rank}.pid")
    with open(tmp, "w") as f:
        f.write(str(os.getpid()))
    os.replace(tmp, os.path.join(FLAGS, f"rank{rank}.pid"))
    time.sleep(600)


if __name__ == "__main__":
    SAVE_DIR, FLAGS, STAGE = sys.argv[1], sys.argv[2], int(sys.argv[3])
    setup = setup_for(2, STAGE, steps=2)
    engine = make_engine(setup)
    train(engine, setup, 0, 1)
    engine.save_checkpoint(SAVE_DIR, tag="first")
    writer._test_pause = hold
    train(engine, setup, 1, 2)
    engine.save_checkpoint(SAVE_DIR, tag="second")
    print("the second save finished: the test expected it to be killed", flush=True)
