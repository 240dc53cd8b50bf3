"""A training script written for DeepSpeed, NOT edited for meshspeed: it imports `deepspeed`.

Run under `meshspeed run --deepspeed-compat --num_gpus 2`. It follows the shape of
DeepSpeed's cifar / HelloDeepSpeed examples: `--local_rank` from the launcher,
`deepspeed.add_config_arguments`, `deepspeed.init_distributed`, `get_accelerator()`,
MoE parameter groups, `deepspeed.initialize(args=..., model=..., model_parameters=...)`,
`model_engine.backward/step`, `save_checkpoint`, then `zero_to_fp32`.
"""

import argparse
import os
import sys

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from deepspeed.pipe import LayerSpec
from deepspeed.utils import RepeatingLoader, log_dist
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = LayerSpec(nn.Linear, 16, 32).build()
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def main():
    parser = argparse.ArgumentParser(description="unchanged DeepSpeed script")
    parser.add_argument("--local_rank", type=int, default=-1, help="passed by the launcher")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--save_dir", type=str, required=True)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)

    # the launcher's --local_rank is this process's local rank, as under DeepSpeed
    assert args.local_rank == int(os.environ["LOCAL_RANK"]), (args.local_rank, os.environ["LOCAL_RANK"])
    deepspeed.init_distributed()
    get_accelerator().set_device(args.local_rank)
    deepspeed.runtime.utils.set_random_seed(1234)  # reached as attributes, as pipeline examples do

    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 16, generator=g)
    y = x[:, :4].argmax(dim=1)
    trainset = torch.utils.data.TensorDataset(x, y)
    net = Net()
    parameters = split_params_into_different_moe_groups_for_optimizer(
        {"params": [p for p in net.parameters() if p.requires_grad], "name": "parameters"})
    model_engine, _optimizer, trainloader, _ = deepspeed.initialize(
        args=args, model=net, model_parameters=parameters, training_data=trainset)
    local_device = get_accelerator().device_name(model_engine.local_rank)
    criterion = nn.CrossEntropyLoss()
    losses = []
    for step, (inputs, labels) in enumerate(RepeatingLoader(trainloader)):
        if step == args.steps:
            break
        loss = criterion(model_engine(inputs.to(local_device)), labels.to(local_device))
        model_engine.backward(loss)
        model_engine.step()
        losses.append(loss.item())
    log_dist(f"first {losses[0]:.4f} last {losses[-1]:.4f}", ranks=[0])
    model_engine.save_checkpoint(args.save_dir)

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    import meshspeed

    state = get_fp32_state_dict_from_zero_checkpoint(args.save_dir)
    with deepspeed.zero.GatheredParameters(list(model_engine.module.parameters())):
        live = {k: v.detach().float() for k, v in model_engine.module.state_dict().items()}
    assert state.keys() == live.keys() and all(torch.equal(state[k], live[k]) for k in live)
    assert deepspeed.initialize is meshspeed.initialize and sys.modules["deepspeed.accelerator"] is sys.modules["meshspeed.compat.deepspeed.accelerator"]
    deepspeed.comm.barrier()
    if deepspeed.comm.get_rank() == 0:
        head, tail = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
        print(f"COMPAT steps {model_engine.global_steps} first {head:.4f} last {tail:.4f}")
        print("COMPAT_OK" if tail < head else "COMPAT_NO_PROGRESS")


if __name__ == "__main__":
    main()
