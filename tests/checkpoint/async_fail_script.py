"""Run by test_async_failure.py: one process, an async save whose write fails (disk full),
then the script ends normally (mode "exit") or calls engine.destroy() (mode "destroy")."""

import sys

import torch

import meshspeed
from meshspeed.checkpoint import tensorfile
from meshspeed.models.gpt import GPT, GPTConfig


def _full_disk(f, data):
    raise OSError(28, "No space left on device")


if __name__ == "__main__":
    save_dir, mode = sys.argv[1], sys.argv[2]
    tensorfile._write_chunk = _full_disk  # the disk fills while the thread writes
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=16, max_seq_len=4, n_layer=1, n_head=2, d_model=8))
    engine, *_ = meshspeed.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "checkpoint": {"async_save": True}})
    x = torch.randint(0, 16, (1, 4))
    engine.backward(engine(x, x))
    engine.step()
    engine.save_checkpoint(save_dir)
    if mode == "destroy":
        try:
            engine.destroy()
        except Exception as err:  # noqa: BLE001 - the test reads it
            print(f"destroy raised {type(err).__name__}: {err}")
            sys.exit(7)
    print("training finished")
