"""Mixture of Experts: DeepSpeed's `MoE` layer in your own model, experts spread over 2 ranks.

    meshspeed run --nproc-per-node 2 examples/moe.py --steps 30 --experts 4 --ep 2

`MoE(hidden_size, expert, num_experts, ep_size, k)` (also `deepspeed.moe.layer.MoE` under
the alias) copies `expert` num_experts times and keeps num_experts / ep_size of them on
each rank; a gate sends every token to its top-k experts through all-to-alls over the
expert-parallel group, which `initialize` hands to each MoE layer. The layer returns
(output, l_aux, exp_counts): add l_aux, the load-balancing loss, to yours. The model here
is deliberately small (embedding, one attention-free MoE block, a head: it learns which
byte follows which); the reference GPT has an MoE form too, `GPTConfig(moe_num_experts=8,
moe_ep_size=2)`. docs/moe.md says which bytes each rank holds and what moves.
"""

import argparse

import torch
from torch import nn

import meshspeed
from meshspeed import comm
from meshspeed.data import ByteWindows, RepeatingLoader, stdlib_corpus
from meshspeed.moe.layer import MoE


class ByteMoE(nn.Module):
    def __init__(self, d_model: int, num_experts: int, ep_size: int, k: int):
        super().__init__()
        self.embed = nn.Embedding(256, d_model)
        expert = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))
        self.moe = MoE(hidden_size=d_model, expert=expert, num_experts=num_experts, ep_size=ep_size, k=k)
        self.head = nn.Linear(d_model, 256)

    def forward(self, ids, targets):
        h = self.embed(ids)                      # (batch, seq, d_model)
        out, l_aux, exp_counts = self.moe(h)     # each token through its top-k experts
        logits = self.head(h + out)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        self.exp_counts = exp_counts             # tokens routed to each expert, this rank's batch
        return loss + 0.01 * l_aux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps (default 30)")
    parser.add_argument("--experts", type=int, default=4, help="experts in the layer (default 4)")
    parser.add_argument("--ep", type=int, default=2, help="expert-parallel degree (default 2)")
    parser.add_argument("--top-k", type=int, default=2, choices=[1, 2], help="experts per token (default 2)")
    parser.add_argument("--print-every", type=int, default=5,
                        help="the library prints a step line every N steps (steps_per_print; default 5)")
    parser.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # DeepSpeed launchers
    args = parser.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(0)
    meshspeed.init_distributed()
    model = ByteMoE(d_model=64, num_experts=args.experts, ep_size=args.ep, k=args.top_k)
    train_set, _ = ByteWindows(stdlib_corpus(200_000), seq_len=64).split(0.98)
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "steps_per_print": args.print_every,  # rank 0 prints "[meshspeed] step N, loss X, ..."
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 2},
    }
    engine, _, loader, _ = meshspeed.initialize(model=model, model_parameters=model.parameters(),
                                                training_data=train_set, config=config)
    rank0 = comm.get_rank() == 0
    if rank0:
        print(engine.mesh, flush=True)
        print(f"{model.moe.num_local_experts} of {args.experts} experts on each rank, top-{args.top_k}",
              flush=True)
    batches = iter(RepeatingLoader(loader))
    for step in range(1, args.steps + 1):
        ids, targets = next(batches)
        loss = engine(ids, targets)
        engine.backward(loss)
        engine.step()  # every --print-every steps the library prints the step's loss
        if rank0 and (step % args.print_every == 0 or step == args.steps):
            print(f"step {step}: tokens per expert {model.exp_counts.tolist()}", flush=True)
    if rank0 and args.steps % args.print_every:  # the last step fell between the library's lines
        print(f"final loss {loss.item():.4f} after {step} steps", flush=True)


if __name__ == "__main__":
    main()
