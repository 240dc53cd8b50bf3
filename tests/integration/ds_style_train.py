"""A training script written for DeepSpeed, ported by changing only the import line.

It follows the shape of DeepSpeed's own tutorials (argparse flags from
`add_config_arguments`, `init_distributed`, `initialize(args=..., training_data=...)`,
`get_accelerator().device_name(local_rank)`, `model_engine.backward/step`)."""

import argparse

import torch
from torch import nn

import meshspeed as deepspeed  # the only line that changed


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))

    def forward(self, x):
        return self.body(x)


def main():
    parser = argparse.ArgumentParser(description="toy")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--save_dir", type=str, default=None)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    deepspeed.init_distributed()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 16, generator=g)
    y = (x[:, :4].argmax(dim=1))  # a learnable rule
    trainset = torch.utils.data.TensorDataset(x, y)
    net = Net()
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    model_engine, _optimizer, trainloader, _ = deepspeed.initialize(
        args=args, model=net, model_parameters=parameters, training_data=trainset)
    local_device = deepspeed.get_accelerator().device_name(model_engine.local_rank)
    criterion = nn.CrossEntropyLoss()
    first = last = None
    for _epoch in range(args.epochs):
        for data in trainloader:
            inputs, labels = data[0].to(local_device), data[1].to(local_device)
            outputs = model_engine(inputs)
            loss = criterion(outputs, labels)
            model_engine.backward(loss)
            model_engine.step()
            first = loss.item() if first is None else first
            last = loss.item()
    if args.save_dir:
        model_engine.save_checkpoint(args.save_dir, client_state={"epoch": args.epochs})
        _path, client_state = model_engine.load_checkpoint(args.save_dir)
        assert client_state["epoch"] == args.epochs, client_state
    if deepspeed.comm.get_rank() == 0:
        print(f"steps {model_engine.global_steps} lr {model_engine.get_lr()} first {first:.4f} last {last:.4f}")
        print("DS_STYLE_OK" if last < first else "DS_STYLE_NO_PROGRESS")


if __name__ == "__main__":
    main()
