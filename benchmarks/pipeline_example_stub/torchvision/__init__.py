"""A stand-in for torchvision, only as much as DeepSpeedExamples'
training/pipeline_parallelism/train.py uses, so that script runs unchanged on a CPU machine
without torchvision and without downloading CIFAR-10 (benchmarks/pipeline_example.py puts
this directory first on PYTHONPATH):

- `models.AlexNet(num_classes)`: the AlexNet layer shapes (`features`, `avgpool`,
  `classifier`, as the script's join_layers reads them), benchmarks/pipeline_example_drift.py's
  AlexNetShaped; `models.vgg19` exists (the script imports it) and is not built.
- `datasets.CIFAR10(root, train, download, transform)`: synthetic, learnable 3-channel images
  made from their index (pipeline_example_drift.SyntheticImages, 50,000 of them), no file
  read or written; items are (transform(image), label) pairs, as torchvision's.
- `transforms`: Compose, Resize, CenterCrop, ToTensor, Normalize as plain callables. The
  images are made at their final size (PIPE_EXAMPLE_IMAGE_SIZE, default 64: the smallest at
  which every AlexNet pooling stage still has an output; the script's Resize(256) and
  CenterCrop(224) of CIFAR's 32x32 would make them 224x224, about 12x the convolution work),
  so Resize and CenterCrop leave a tensor as it is; ToTensor passes tensors through;
  Normalize computes (x - mean) / std per channel, as torchvision's.

Environment: PIPE_EXAMPLE_IMAGE_SIZE (pixels on a side, default 64), PIPE_EXAMPLE_DROPOUT
("on", default: AlexNet's two Dropout(0.5); "off": Identity in their place).
"""

from torchvision import datasets, models, transforms

__version__ = "0.0-meshspeed-stub"
__all__ = ["datasets", "models", "transforms"]
