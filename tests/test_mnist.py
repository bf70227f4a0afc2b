"""Tests for the MNIST helpers."""

from __future__ import annotations

import pickle

import numpy as np
import torch

from torchbook.cache import mnist_root
from torchbook.mnist import MNIST_MEAN, MNIST_STD, RandomShift, SlowTransform, mnist_dataset, resident_batches, resident_mnist


def test_resident_batches_visit_every_example_once():
    images = torch.arange(103).float().view(103, 1, 1, 1)
    labels = torch.arange(103)
    seen = []
    for batch_images, batch_labels in resident_batches(images, labels, 10, torch.Generator().manual_seed(0)):
        assert torch.equal(batch_images.flatten(), batch_labels.float()), "images and labels were separated"
        seen += batch_labels.tolist()
    assert sorted(seen) == list(range(103)) and seen != list(range(103))


def test_resident_tensors_match_torchvision_items():
    images, labels = resident_mnist(mnist_root(), train=False, device=torch.device("cpu"))
    reference = mnist_dataset(mnist_root(), train=False)
    assert images.shape == (10_000, 1, 28, 28) and labels.dtype == torch.long
    for index in (0, 1234, 9999):
        pil_image, label = reference[index]
        pixels = torch.from_numpy(np.array(pil_image)).float().view(1, 28, 28) / 255
        # atol 1e-5: the same float32 arithmetic in a different order
        torch.testing.assert_close(images[index], (pixels - MNIST_MEAN) / MNIST_STD, atol=1e-5, rtol=0)
        assert labels[index] == label


def test_transforms_survive_pickling_for_spawned_workers():
    shift = pickle.loads(pickle.dumps(SlowTransform(RandomShift(2), seconds=0.0)))
    image = torch.zeros(1, 28, 28)
    image[0, 14, 14] = 1
    torch.manual_seed(0)
    moved = shift(image)
    assert moved.sum() == 1 and moved.shape == image.shape
