"""torchvision.datasets for the pipeline example: a synthetic CIFAR10 (see the package docstring)."""

import os

from pipeline_example_drift import SyntheticImages


class CIFAR10(SyntheticImages):
    def __init__(self, root=None, train=True, transform=None, target_transform=None, download=False):
        super().__init__(int(os.environ.get("PIPE_EXAMPLE_IMAGE_SIZE", "64")))
        self.root, self.train = root, train
        self.transform, self.target_transform = transform, target_transform

    def __getitem__(self, i):
        image, label, _ = super().__getitem__(i)
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            label = self.target_transform(label)
        return image, label
