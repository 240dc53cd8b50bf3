"""An accelerate training loop the way users write it, unchanged for DeepSpeed and meshspeed:

    accelerate launch --use_deepspeed --num_processes 2 --zero_stage 2 \\
        tests/compat/hf_accelerate.py --out DIR
    torchrun --nproc_per_node 2 tests/compat/hf_accelerate.py --stage 3 --out DIR

With `--stage` the script builds its own `DeepSpeedPlugin(zero_stage=...)`; without it the
plugin comes from `accelerate launch`'s flags. A tiny random-init GPT-2, a torch AdamW and
a linear schedule, gradient accumulation 2, `clip_grad_norm_`; after step 4 it saves the
state, trains to step 6, loads the state back and trains steps 5-8 again, so the losses
after the load must repeat those before it. It prints `LOSS <step> <loss>` (rank 0, the
loss of each optimizer step summed over its micro-batches), `GRAD_NORM <step> <norm>`,
and at the end compares `get_state_dict` (gathered) with the unwrapped model's weights.
"""

from __future__ import annotations

import argparse
import os

import torch
from accelerate import Accelerator, DeepSpeedPlugin
from accelerate.utils import InitProcessGroupKwargs
from accelerate.utils import set_seed
from transformers import AutoModelForCausalLM, GPT2Config, get_linear_schedule_with_warmup

GAS, MICRO, STEPS, SAVE_AT = 2, 2, 8, 4


def batches(vocab: int) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, vocab, (64, 16), generator=g)
    return torch.utils.data.DataLoader([{"input_ids": x, "labels": x} for x in ids], batch_size=MICRO, shuffle=False)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, default=None)
    parser.add_argument("--out", required=True)
    parser.add_argument("--local_rank", type=int, default=-1)  # the deepspeed launcher passes it
    args = parser.parse_args()
    torch.set_num_threads(1)
    plugin = (DeepSpeedPlugin(zero_stage=args.stage, gradient_accumulation_steps=GAS, gradient_clipping=1.0,
                              zero3_save_16bit_model=True)
              if args.stage is not None else None)
    # On a machine with no GPU accelerate finds no device backend for a DeepSpeed job and
    # counts it as one process; naming gloo makes it see both ranks, as it does on GPUs.
    gloo = InitProcessGroupKwargs(backend="gloo")
    accelerator = Accelerator(deepspeed_plugin=plugin, gradient_accumulation_steps=GAS, kwargs_handlers=[gloo])
    set_seed(5)
    gpt = GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = AutoModelForCausalLM.from_config(gpt)
    decay = [p for n, p in model.named_parameters() if not n.endswith("bias") and "ln_" not in n]
    rest = [p for n, p in model.named_parameters() if n.endswith("bias") or "ln_" in n]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}],
                                  lr=3e-3)
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=2, num_training_steps=STEPS)
    loader = batches(gpt.vocab_size)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    def train(first: int, last: int) -> None:
        step, micro, total = first, 0, 0.0
        for i, batch in enumerate(loader):
            if i < (first - 1) * GAS:
                continue
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                total += float(loss.detach())
                micro += 1
                if accelerator.sync_gradients:
                    norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if micro == GAS:
                if accelerator.is_main_process:
                    print(f"LOSS {step} {total:.9g}", flush=True)
                    print(f"GRAD_NORM {step} {float(norm):.9g}", flush=True)
                step, micro, total = step + 1, 0, 0.0
                if step > last:
                    return

    train(1, SAVE_AT)
    state = os.path.join(args.out, "state")
    accelerator.save_state(state)
    train(SAVE_AT + 1, SAVE_AT + 2)
    accelerator.load_state(state)
    train(SAVE_AT + 1, STEPS)

    whole = accelerator.get_state_dict(model)  # gathered whole on rank 0 under ZeRO-3
    unwrapped = accelerator.unwrap_model(model)
    if accelerator.is_main_process:
        assert type(unwrapped).__name__ == "GPT2LMHeadModel", type(unwrapped)
        names = sorted(whole)
        print(f"STATE_DICT {len(names)} tensors {sum(t.numel() for t in whole.values())} numbers", flush=True)
        norm = torch.sqrt(sum((t.double() ** 2).sum() for t in whole.values()))
        print(f"PARAMS {float(norm):.9g}", flush=True)
    accelerator.save_model(model, os.path.join(args.out, "final"))
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
