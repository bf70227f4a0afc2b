"""MNIST two ways: torchvision's dataset through a DataLoader, and the whole set as resident tensors.

MNIST is 60,000 images of 28x28 bytes, 47 MB as bytes: it fits in memory many
times over. Decoding each image into a PIL image and back into a tensor on
every epoch (what ``torchvision.datasets.MNIST`` with ``ToTensor`` does) costs
far more than the model on it; keeping the normalized tensors resident and
indexing a shuffled permutation makes an epoch a handful of tensor ops.

Also here, so DataLoader workers can pickle them under ``spawn``: transforms
used in the book's DataLoader demonstrations.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Iterator

import torch
from torchvision import datasets

MNIST_MEAN = 0.1307  # mean pixel of the training images, scaled to [0, 1]
MNIST_STD = 0.3081


def mnist_dataset(root: Path | str, train: bool, transform=None) -> datasets.MNIST:
    """torchvision's MNIST from ``root`` (which holds ``MNIST/raw``); never downloads."""
    return datasets.MNIST(root=str(root), train=train, transform=transform, download=False)


def resident_mnist(root: Path | str, train: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """All images as normalized float32 ``(N, 1, 28, 28)`` and labels as int64 ``(N,)``, on ``device``."""
    raw = mnist_dataset(root, train)
    images = (raw.data.to(device=device, dtype=torch.float32).div_(255) - MNIST_MEAN) / MNIST_STD
    return images.unsqueeze(1), raw.targets.to(device=device, dtype=torch.long)


def resident_batches(
    images: torch.Tensor, labels: torch.Tensor, batch_size: int, generator: torch.Generator | None = None
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """One shuffled epoch of ``(images, labels)`` batches by indexing; the last batch may be smaller."""
    order = torch.randperm(len(images), generator=generator, device="cpu").to(images.device)
    for start in range(0, len(images), batch_size):
        index = order[start : start + batch_size]
        # index_select copies whole rows; images[index] takes the general advanced-indexing path, several times slower
        yield images.index_select(0, index), labels.index_select(0, index)


class SlowTransform:
    """Wrap a transform and wait ``seconds`` per item: stands in for costly decoding or remote reads.

    It sleeps rather than computes, so what it shows is overlap between the
    loader and the training step, not how many cores the machine has.
    """

    def __init__(self, transform, seconds: float) -> None:
        self.transform = transform
        self.seconds = seconds

    def __call__(self, item):
        time.sleep(self.seconds)
        return self.transform(item)


class RandomShift:
    """Shift a ``(1, H, W)`` image by up to ``pixels`` in each direction, drawn from torch's global RNG.

    DataLoader seeds torch's RNG in each worker from its base seed plus the
    worker id, so the shifts differ across workers and repeat when the
    loader's ``generator`` is seeded.
    """

    def __init__(self, pixels: int) -> None:
        self.pixels = pixels

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        dy, dx = torch.randint(-self.pixels, self.pixels + 1, (2,)).tolist()
        return torch.roll(image, shifts=(dy, dx), dims=(1, 2))
