"""A Hugging Face Trainer script the way users write it, unchanged for DeepSpeed and meshspeed:
a tiny random-init GPT-2 from `GPT2Config`, a synthetic dataset, `TrainingArguments(deepspeed=
<ds_config.json with "auto" values>)`. Run under torchrun with 2 processes:

    torchrun --nproc_per_node 2 tests/compat/hf_trainer.py --stage 3 --out DIR [--offload]
        [--resume DIR/checkpoint-4]

It prints `LOSS <step> <loss>` for each optimizer step (the sum over its micro-batches, at
full precision, rank 0), and after training saves the model with `trainer.save_model()`.
`--no-ds-optimizer` leaves the optimizer and scheduler sections out of the config (the
Trainer then builds a torch AdamW and a linear schedule itself).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from accelerate import PartialState
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, GPT2Config, Trainer, TrainingArguments

STEPS, SAVE_STEPS, GAS, MICRO = 8, 4, 2, 2


def ds_config(stage: int, offload: bool, ds_optimizer: bool) -> dict:
    """Hugging Face's documented ds_config, "auto" wherever it puts one."""
    zero: dict = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True,
                  "reduce_bucket_size": "auto"}
    if stage == 3:
        zero.update({"stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
                     "stage3_gather_16bit_weights_on_model_save": True})
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    config: dict = {
        "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
        "zero_optimization": zero,
        "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
        "steps_per_print": 2000, "wall_clock_breakdown": False,
    }
    if ds_optimizer:
        config["optimizer"] = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                           "weight_decay": "auto"}}
        config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                              "warmup_num_steps": "auto"}}
    return config


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, length: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(7)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class LossTrainer(Trainer):
    """Prints each optimizer step's loss at full precision (the Trainer's log rounds it)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._micro: list[float] = []

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        self._micro.append(float(loss))
        if len(self._micro) == GAS:
            if self.args.process_index == 0:
                print(f"LOSS {self.state.global_step + 1} {sum(self._micro):.9g}", flush=True)
            self._micro = []
        return loss


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, required=True)
    parser.add_argument("--offload", action="store_true")
    parser.add_argument("--no-ds-optimizer", action="store_true")
    parser.add_argument("--out", required=True)
    parser.add_argument("--local_rank", type=int, default=-1)  # the deepspeed launcher passes it
    parser.add_argument("--resume", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.makedirs(args.out, exist_ok=True)
    config_path = os.path.join(args.out, "ds_config.json")
    tmp = f"{config_path}.{os.environ.get('RANK', '0')}.tmp"  # every rank writes the same file
    with open(tmp, "w") as f:
        json.dump(ds_config(args.stage, args.offload, not args.no_ds_optimizer), f, indent=1)
    os.replace(tmp, config_path)
    # On a machine with no GPU, accelerate finds no device backend for a DeepSpeed job and
    # counts it as one process (so does DeepSpeed's Trainer path); naming gloo first makes it
    # see both ranks, as it does on GPUs. Nothing else here depends on the device.
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")
    training = TrainingArguments(
        accelerator_config={"use_configured_state": True},
        output_dir=args.out, deepspeed=config_path, per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=GAS, max_steps=STEPS, learning_rate=3e-3, warmup_steps=2,
        weight_decay=0.01, max_grad_norm=1.0, logging_steps=1, save_steps=SAVE_STEPS, save_strategy="steps",
        report_to=[], seed=11, data_seed=11, dataloader_num_workers=0, disable_tqdm=True)
    torch.manual_seed(3)
    gpt = GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = AutoModelForCausalLM.from_config(gpt)  # under ZeRO-3 this runs inside deepspeed.zero.Init
    trainer = LossTrainer(model=model, args=training, train_dataset=Tokens(64, 16, gpt.vocab_size))
    trainer.train(resume_from_checkpoint=args.resume)
    final = os.path.join(args.out, "final")
    trainer.save_model(final)
    saved = load_file(os.path.join(final, "model.safetensors")) if training.process_index == 0 else {}
    for name in sorted(saved):
        print(f"WEIGHT {name} {tuple(saved[name].shape)} {float(saved[name].double().norm()):.9g}", flush=True)
    if args.stage == 3:
        sharded_load(final)
    if training.process_index == 0:
        print("SAVED", flush=True)


def sharded_load(path: str) -> None:
    """`from_pretrained` while the Trainer's DeepSpeed config is live: under ZeRO-3 it builds
    the model inside `zero.Init` and loads the file into the shards. Prints the share of the
    model's numbers this rank holds and how far the gathered weights are from the file."""
    import deepspeed

    from transformers.integrations import is_deepspeed_zero3_enabled

    assert is_deepspeed_zero3_enabled()
    torch.distributed.barrier()  # rank 0 has written the file (save_model does not wait for it)
    model = AutoModelForCausalLM.from_pretrained(path)
    params = list(model.parameters())
    local = sum(p.ds_tensor.numel() for p in params)
    total = sum(p.ds_numel for p in params)
    file = load_file(os.path.join(path, "model.safetensors"))
    with deepspeed.zero.GatheredParameters(params):
        diff = max(float((p.detach() - file[n]).abs().max()) for n, p in model.named_parameters())
    if torch.distributed.get_rank() == 0:
        print(f"FROM_PRETRAINED local share {local / total:.2f} max |diff| {diff:.3g}", flush=True)


if __name__ == "__main__":
    main()
