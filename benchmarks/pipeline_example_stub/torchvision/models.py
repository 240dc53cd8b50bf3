"""torchvision.models for the pipeline example: AlexNet's shapes (see the package docstring)."""

import os

from pipeline_example_drift import AlexNetShaped


def AlexNet(num_classes: int = 1000):  # torchvision's class name
    return AlexNetShaped(num_classes=num_classes, dropout=os.environ.get("PIPE_EXAMPLE_DROPOUT", "on") == "on")


def vgg19(*args, **kwargs):
    raise NotImplementedError("the torchvision stub of benchmarks/pipeline_example.py builds AlexNet only")
