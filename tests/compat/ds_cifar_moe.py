"""A Mixture-of-Experts training script written for DeepSpeed, NOT edited for meshspeed.

It has the shape of DeepSpeedExamples' training/cifar/cifar10_deepspeed.py as its MoE runs
call it (run_ds_moe.sh: `--moe --ep-world-size 2 --num-experts 2 --top-k 1
--noisy-gate-policy RSample --moe-param-group`; run_ds_prmoe.sh: `--num-experts 2 4
--mlp-type residual`): argparse with `deepspeed.add_config_arguments`, `--local_rank`,
`deepspeed.init_distributed()`, `get_accelerator().set_device(LOCAL_RANK)`, the barrier
around the data, a LeNet whose head is one `deepspeed.moe.layer.MoE(hidden_size=84,
expert=fc3, num_experts=n, ep_size=..., use_residual=..., k=..., min_capacity=...,
noisy_gate_policy=...)` per entry of --num-experts (all copies of the same fc3),
`split_params_into_different_moe_groups_for_optimizer`, the script's DeepSpeed config
(Adam with weight decay, WarmupLR, clipping 1.0, ZeRO block) passed as
`deepspeed.initialize(args=..., model=..., model_parameters=..., training_data=...,
config=...)`, the loop over the engine's loader with `model_engine.backward/step`, and its
test() pass in eval mode.

What differs, for a test on two CPU ranks: the data are synthetic CIFAR-shaped tensors
made here from fixed seeds (no torchvision, no download); the model is seeded before it is
built (`--seed`; the example does not seed, so its ranks start their experts apart); the
config's numbers are sized for a few steps (lr, warmup); `--dtype` defaults to fp32; and
`--aux-loss-coef` (default 0, the example's behaviour of discarding l_aux) adds the
coefficient times the sum of the layers' l_aux to the loss, as DeepSpeed's MoE tutorial
does.

What it prints (besides the example's own lines):
    LOSS rank=<r> step=<s> loss=<float>     every rank, every step: its own batch's loss
"""

import argparse
import os

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from torch import nn

CLASSES = 10
TRAIN_SAMPLES, TEST_SAMPLES = 64, 16  # 64 = 4 steps of 16 per epoch
LR, WARMUP = 0.01, 4


def add_argument():
    parser = argparse.ArgumentParser(description="CIFAR")

    # For train.
    parser.add_argument("-e", "--epochs", default=2, type=int, help="number of total epochs")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("--log-interval", type=int, default=2000,
                        help="output logging information at a given interval")
    parser.add_argument("--seed", type=int, default=1234, help="seed of the model's weights")

    # For mixed precision training.
    parser.add_argument("--dtype", default="fp32", type=str, choices=["bf16", "fp16", "fp32"],
                        help="Datatype used for training")

    # For ZeRO Optimization.
    parser.add_argument("--stage", default=0, type=int, choices=[0, 1, 2, 3], help="ZeRO stage")

    # For MoE (Mixture of Experts).
    parser.add_argument("--moe", default=False, action="store_true", help="use deepspeed mixture of experts (moe)")
    parser.add_argument("--ep-world-size", default=1, type=int, help="(moe) expert parallel world size")
    parser.add_argument("--num-experts", type=int, nargs="+", default=[1],
                        help="number of experts list, MoE related.")
    parser.add_argument("--mlp-type", type=str, default="standard",
                        help="Only applicable when num-experts > 1, accepts [standard, residual]")
    parser.add_argument("--top-k", default=1, type=int, help="(moe) gating top 1 and 2 supported")
    parser.add_argument("--min-capacity", default=0, type=int,
                        help="(moe) minimum capacity of an expert regardless of the capacity_factor")
    parser.add_argument("--noisy-gate-policy", default=None, type=str,
                        help="(moe) noisy gating (only supported with top-1). Valid values are None, RSample, and Jitter")
    parser.add_argument("--moe-param-group", default=False, action="store_true",
                        help="(moe) create separate moe param groups, required when using ZeRO w. MoE")
    parser.add_argument("--aux-loss-coef", default=0.0, type=float, help="(moe) weight of the layers' l_aux")

    # Include DeepSpeed configuration arguments.
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def create_moe_param_groups(model):
    """Create separate parameter groups for each expert."""
    parameters = {"params": [p for p in model.parameters()], "name": "parameters"}
    return split_params_into_different_moe_groups_for_optimizer(parameters)


def get_ds_config(args):
    """The example's DeepSpeed configuration, its numbers sized for a few steps."""
    return {
        "train_batch_size": 16,
        "steps_per_print": 2000,
        "optimizer": {
            "type": "Adam",
            "params": {"lr": LR, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7},
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0, "warmup_max_lr": LR, "warmup_num_steps": WARMUP},
        },
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "bf16": {"enabled": args.dtype == "bf16"},
        "fp16": {
            "enabled": args.dtype == "fp16",
            "fp16_master_weights_and_grads": False,
            "loss_scale": 0,
            "loss_scale_window": 500,
            "hysteresis": 2,
            "min_loss_scale": 1,
            "initial_scale_power": 15,
        },
        "wall_clock_breakdown": False,
        "zero_optimization": {
            "stage": args.stage,
            "allgather_partitions": True,
            "reduce_scatter": True,
            "allgather_bucket_size": 50000000,
            "reduce_bucket_size": 50000000,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "cpu_offload": False,
        },
    }


class Net(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.moe = args.moe
        if self.moe:
            fc3 = nn.Linear(84, 84)
            self.moe_layer_list = []
            for n_e in args.num_experts:
                # Create moe layers based on the number of experts.
                self.moe_layer_list.append(
                    deepspeed.moe.layer.MoE(
                        hidden_size=84,
                        expert=fc3,
                        num_experts=n_e,
                        ep_size=args.ep_world_size,
                        use_residual=args.mlp_type == "residual",
                        k=args.top_k,
                        min_capacity=args.min_capacity,
                        noisy_gate_policy=args.noisy_gate_policy,
                    ))
            self.moe_layer_list = nn.ModuleList(self.moe_layer_list)
            self.fc4 = nn.Linear(84, 10)
        else:
            self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 5 * 5)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        if self.moe:
            self.l_aux = 0.0
            for layer in self.moe_layer_list:
                x, l_aux, _ = layer(x)
                self.l_aux = self.l_aux + l_aux
            x = self.fc4(x)
        else:
            x = self.fc3(x)
        return x


def synthetic_cifar(samples, seed):
    """CIFAR-shaped (3 x 32 x 32, in about [-1, 1] as the example normalises them), learnable:
    a fixed pattern per class plus noise; labels cycle through the classes."""
    g = torch.Generator().manual_seed(seed)
    patterns = torch.rand(CLASSES, 3, 32, 32, generator=torch.Generator().manual_seed(7)) * 2 - 1
    labels = torch.arange(samples) % CLASSES
    images = (0.6 * patterns[labels] + 0.4 * (torch.rand(samples, 3, 32, 32, generator=g) * 2 - 1))
    return torch.utils.data.TensorDataset(images, labels)


def test(model_engine, testset, local_device, target_dtype, test_batch_size=4):
    """Test the network on the test data (the example's test(), shortened)."""
    testloader = torch.utils.data.DataLoader(testset, batch_size=test_batch_size, shuffle=False, num_workers=0)
    correct, total = 0, 0
    model_engine.eval()
    with torch.no_grad():
        for data in testloader:
            images, labels = data
            if target_dtype is not None:
                images = images.to(target_dtype)
            outputs = model_engine(images.to(local_device))
            _, predicted = torch.max(outputs.data, 1)
            total += labels.size(0)
            correct += (predicted == labels.to(local_device)).sum().item()
    if model_engine.local_rank == 0:
        print(f"Accuracy of the network on the {total} test images: {100 * correct / total : .0f} %")


def main(args):
    # Initialize DeepSpeed distributed backend.
    deepspeed.init_distributed()
    _local_rank = int(os.environ.get("LOCAL_RANK"))
    get_accelerator().set_device(_local_rank)

    if torch.distributed.get_rank() != 0:
        # Might be downloading cifar data, let rank 0 download first.
        torch.distributed.barrier()
    trainset = synthetic_cifar(TRAIN_SAMPLES, seed=1)
    testset = synthetic_cifar(TEST_SAMPLES, seed=2)
    if torch.distributed.get_rank() == 0:
        # Cifar data is downloaded, indicate other ranks can proceed.
        torch.distributed.barrier()

    torch.manual_seed(args.seed)
    net = Net(args)

    # Get list of parameters that require gradients.
    parameters = filter(lambda p: p.requires_grad, net.parameters())

    # If using MoE, create separate param groups for each expert.
    if args.moe_param_group:
        parameters = create_moe_param_groups(net)

    ds_config = get_ds_config(args)
    model_engine, _optimizer, trainloader, __ = deepspeed.initialize(
        args=args,
        model=net,
        model_parameters=parameters,
        training_data=trainset,
        config=ds_config,
    )

    local_device = get_accelerator().device_name(model_engine.local_rank)
    local_rank = model_engine.local_rank
    rank = torch.distributed.get_rank()

    # For float32, target_dtype will be None so no datatype conversion needed.
    target_dtype = None
    if model_engine.bfloat16_enabled():
        target_dtype = torch.bfloat16
    elif model_engine.fp16_enabled():
        target_dtype = torch.half

    criterion = nn.CrossEntropyLoss()

    step = 0
    for epoch in range(args.epochs):  # loop over the dataset multiple times
        running_loss = 0.0
        for i, data in enumerate(trainloader):
            inputs, labels = data[0].to(local_device), data[1].to(local_device)
            if target_dtype is not None:
                inputs = inputs.to(target_dtype)

            outputs = model_engine(inputs)
            loss = criterion(outputs, labels)
            if args.aux_loss_coef:
                loss = loss + args.aux_loss_coef * model_engine.module.l_aux

            model_engine.backward(loss)
            model_engine.step()

            step += 1
            print(f"LOSS rank={rank} step={step} loss={loss.item()!r}", flush=True)
            running_loss += loss.item()
            if local_rank == 0 and i % args.log_interval == (args.log_interval - 1):
                print(f"[{epoch + 1 : d}, {i + 1 : 5d}] loss: {running_loss / args.log_interval : .3f}")
                running_loss = 0.0
    print("Finished Training")

    test(model_engine, testset, local_device, target_dtype)


if __name__ == "__main__":
    args = add_argument()
    main(args)
