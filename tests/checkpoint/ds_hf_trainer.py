"""A Hugging Face Trainer script, unchanged between DeepSpeed and meshspeed, that saves
`checkpoint-<N>` folders and resumes from one: used to move a Trainer run from one to the
other mid-training (benchmarks/ds_hf_checkpoint.py, tests/checkpoint/test_ds_hf.py).

    torchrun --nproc_per_node P tests/checkpoint/ds_hf_trainer.py --stage S --out DIR
        [--resume DIR/checkpoint-3] [--trail] [--hf-optimizer]

A tiny random-init GPT-2 built from its config (nothing downloaded), a synthetic token
dataset, `TrainingArguments(deepspeed=<ds_config.json>)`: 6 optimizer steps of 2
micro-batches, a checkpoint every 3. It prints `LOSS <step> <loss>` per optimizer step
(rank 0's sum over its micro-batches, full precision). `--trail` puts
`"checkpoint": {"format": "deepspeed"}` in the config, which makes meshspeed write
DeepSpeed's files into each checkpoint too (DeepSpeed ignores the key). `--hf-optimizer`
leaves the optimizer and scheduler out of the config, so the Trainer builds torch AdamW
and its linear schedule (saved by the Trainer as scheduler.pt).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from accelerate import PartialState
from transformers import AutoModelForCausalLM, GPT2Config, TrainingArguments

# The dataset and the loss-printing Trainer are tests/compat/hf_trainer.py's (run as a script,
# under DeepSpeed's venv too, so by path rather than as the `tests` package)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "compat"))
from hf_trainer import GAS, LossTrainer, Tokens

STEPS, SAVE_STEPS, MICRO = 6, 3, 2


def ds_config(stage: int, trail: bool, ds_optimizer: bool) -> dict:
    config: dict = {
        "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": "auto"},
        "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
        "steps_per_print": 2000, "wall_clock_breakdown": False,
    }
    if trail:
        config["checkpoint"] = {"format": "deepspeed"}
    if ds_optimizer:
        config["optimizer"] = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                           "weight_decay": "auto"}}
        config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                              "warmup_num_steps": "auto"}}
    return config


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--trail", action="store_true")
    parser.add_argument("--hf-optimizer", action="store_true")
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.makedirs(args.out, exist_ok=True)
    config_path = os.path.join(args.out, "ds_config.json")
    tmp = f"{config_path}.{os.environ.get('RANK', '0')}.tmp"  # every rank writes the same file
    with open(tmp, "w") as f:
        json.dump(ds_config(args.stage, args.trail, not args.hf_optimizer), f, indent=1)
    os.replace(tmp, config_path)
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"  # gloo on a machine with no GPU (see hf_trainer.py)
    PartialState(backend="gloo")
    training = TrainingArguments(
        accelerator_config={"use_configured_state": True},
        output_dir=args.out, deepspeed=config_path, per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=GAS, max_steps=STEPS, learning_rate=3e-3, warmup_steps=2,
        weight_decay=0.01, max_grad_norm=1.0, logging_steps=1, save_steps=SAVE_STEPS, save_strategy="steps",
        report_to=[], seed=11, data_seed=11, dataloader_num_workers=0, disable_tqdm=True)
    torch.manual_seed(3)
    gpt = GPT2Config(vocab_size=32, n_positions=16, n_embd=8, n_layer=1, n_head=2,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = AutoModelForCausalLM.from_config(gpt)
    trainer = LossTrainer(model=model, args=training, train_dataset=Tokens(48, 8, gpt.vocab_size))
    trainer.train(resume_from_checkpoint=args.resume)
    if training.process_index == 0:
        print("DONE", flush=True)


if __name__ == "__main__":
    main()
