"""Hugging Face's `Trainer` with `--deepspeed ds_config.json`, unchanged, on meshspeed.

    meshspeed run --deepspeed-compat --nproc-per-node 2 examples/hf_trainer.py --deepspeed examples/ds_config.json

This is a Trainer script as written for DeepSpeed: `TrainingArguments(deepspeed=<a
ds_config with "auto" values>)`. Under `meshspeed run --deepspeed-compat`, and only in the
launched processes, `import deepspeed` gives meshspeed; after `meshspeed compat install`
the same script runs under torchrun, accelerate launch or python too (docs/deepspeed_compat.md).
The model is a small GPT-2 built from its config (random weights, nothing downloaded),
trained on byte windows of the Python standard library's source.
"""

import argparse
import os

import torch
from accelerate import PartialState
from transformers import AutoModelForCausalLM, GPT2Config, Trainer, TrainingArguments

from meshspeed.data import ByteWindows, stdlib_corpus


class Bytes(torch.utils.data.Dataset):
    """Byte windows in the Trainer's format: dicts of input_ids and labels."""

    def __init__(self, windows: ByteWindows):
        self.windows = windows

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict:
        ids, _ = self.windows[i]
        return {"input_ids": ids, "labels": ids}  # transformers shifts the labels itself


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--deepspeed", default=None, metavar="DS_CONFIG", help="a DeepSpeed config (JSON)")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps (default 20)")
    parser.add_argument("--output-dir", default="hf_trainer_out", help="checkpoints and the saved model")
    parser.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # DeepSpeed launchers
    args = parser.parse_args()

    torch.set_num_threads(1)
    if not torch.cuda.is_available():
        # On a machine without GPUs accelerate finds no device backend for a DeepSpeed job and
        # would count one process; naming gloo first lets it see every rank.
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        PartialState(backend="gloo")
    training = TrainingArguments(
        output_dir=args.output_dir, deepspeed=args.deepspeed, max_steps=args.steps,
        per_device_train_batch_size=4, gradient_accumulation_steps=2, learning_rate=3e-3,
        warmup_steps=2, weight_decay=0.01, max_grad_norm=1.0, logging_steps=5, save_strategy="no",
        report_to=[], disable_tqdm=True, dataloader_num_workers=0, dataloader_pin_memory=False,
        accelerator_config={"use_configured_state": True})
    torch.manual_seed(0)
    gpt2 = GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                      bos_token_id=None, eos_token_id=None)  # bytes: no special tokens
    model = AutoModelForCausalLM.from_config(gpt2)  # under ZeRO-3: inside deepspeed.zero.Init
    train_set, _ = ByteWindows(stdlib_corpus(200_000), seq_len=64).split(0.98)
    trainer = Trainer(model=model, args=training, train_dataset=Bytes(train_set))
    trainer.train()  # logs {'loss': ..., 'learning_rate': ...} every logging_steps on rank 0
    trainer.save_model(os.path.join(args.output_dir, "final"))
    if training.process_index == 0:
        engine = type(trainer.model_wrapped)
        print(f"trained by {engine.__module__}.{engine.__name__}", flush=True)
        print(f"saved {os.path.join(args.output_dir, 'final')}", flush=True)


if __name__ == "__main__":
    main()
