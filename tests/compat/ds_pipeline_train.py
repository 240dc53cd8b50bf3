"""A pipeline-parallel training script written for DeepSpeed, NOT edited for meshspeed.

It has the shape of DeepSpeedExamples' training/pipeline_parallelism/train.py: argparse with
`deepspeed.add_config_arguments`, `--local_rank`, `-p/--pipeline-parallel-size`, `--steps`,
`--backend`, `--seed`; `deepspeed.init_distributed`; a conv net's layers joined into one list
with a flatten between them; `PipelineModule(...)`, `deepspeed.initialize(...,
training_data=trainset)` and `engine.train_batch()` once per step, reading the engine's own
loader. The model is small and the data are synthetic (no torchvision, no download), so the
test (tests/compat/test_pipeline_example.py) runs it on two CPU ranks in seconds.

What it prints, for the test to read:
    STAGE rank=<r> first=<bool> last=<bool> params=<n>    every rank
    LOSS step=<s> loss=<float>                             rank 0, every step
"""

import argparse
import os

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.pipe import PipelineModule
from deepspeed.utils import RepeatingLoader
from torch import nn

IMAGE = 8  # pixels on a side
CLASSES = 10
SAMPLES = 512


def conv_net():
    """A small AlexNet-shaped net: features, pool, classifier (what join_layers expects)."""
    net = nn.Module()
    net.features = nn.Sequential(
        nn.Conv2d(3, 8, kernel_size=3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, kernel_size=3, padding=1), nn.ReLU(inplace=True),
    )
    net.avgpool = nn.AdaptiveAvgPool2d((2, 2))
    net.classifier = nn.Sequential(
        nn.Linear(16 * 2 * 2, 32), nn.ReLU(inplace=True), nn.Linear(32, CLASSES),
    )
    return net


def synthetic_trainset():
    """Learnable images: noise plus a fixed per-class pattern, made from a fixed seed."""
    g = torch.Generator().manual_seed(7)
    patterns = torch.randn(CLASSES, 3, IMAGE, IMAGE, generator=g)
    labels = torch.randint(CLASSES, (SAMPLES,), generator=g)
    images = torch.randn(SAMPLES, 3, IMAGE, IMAGE, generator=g) + patterns[labels]
    return torch.utils.data.TensorDataset(images, labels)


def join_layers(vision_model):
    return [
        *vision_model.features,
        vision_model.avgpool,
        lambda x: torch.flatten(x, 1),
        *vision_model.classifier,
    ]


def get_args():
    parser = argparse.ArgumentParser(description="pipeline example, small")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("-s", "--steps", type=int, default=4, help="quit after this many steps")
    parser.add_argument("-p", "--pipeline-parallel-size", type=int, default=2, help="pipeline parallelism")
    parser.add_argument("--backend", type=str, default="gloo", help="distributed backend")
    parser.add_argument("--seed", type=int, default=1138, help="PRNG seed")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def train_pipe(args, part="parameters"):
    torch.manual_seed(args.seed)
    deepspeed.runtime.utils.set_random_seed(args.seed)

    net = conv_net()
    net = PipelineModule(layers=join_layers(net),
                         loss_fn=torch.nn.CrossEntropyLoss(),
                         num_stages=args.pipeline_parallel_size,
                         partition_method=part,
                         activation_checkpoint_interval=0)

    trainset = synthetic_trainset()
    engine, _, _, _ = deepspeed.initialize(
        args=args,
        model=net,
        model_parameters=[p for p in net.parameters() if p.requires_grad],
        training_data=trainset)

    rank = dist.get_rank()
    n_params = sum(p.numel() for p in net.parameters())
    print(f"STAGE rank={rank} first={engine.is_first_stage()} last={engine.is_last_stage()} "
          f"params={n_params}", flush=True)
    assert isinstance(RepeatingLoader, type)  # imported as the example does
    for step in range(args.steps):
        loss = engine.train_batch()
        if rank == 0:
            print(f"LOSS step={step + 1} loss={float(loss)!r}", flush=True)


if __name__ == "__main__":
    args = get_args()
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend=args.backend)
    args.local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        torch.cuda.set_device(args.local_rank)
    train_pipe(args)
