"""Tests of the MNIST helpers: raw files only, bad ones refused by name; transforms."""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from torchvision import datasets

from torchbook.book.download import mnist_root
from torchbook.book.mnist import (
    MNIST_MEAN,
    MNIST_STD,
    MnistFormatError,
    RandomShift,
    SlowTransform,
    mnist_dataset,
    resident_batches,
    resident_mnist,
)

TEST_FILES = ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def copy_test_split(target: Path) -> Path:
    """A data folder holding a copy of the verified test split's raw files."""
    raw = target / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for name in TEST_FILES:
        shutil.copyfile(mnist_root() / "MNIST" / "raw" / name, raw / name)
    return raw


def test_resident_batches_visit_every_example_once():
    images = torch.arange(103).float().view(103, 1, 1, 1)
    labels = torch.arange(103)
    seen = []
    for batch_images, batch_labels in resident_batches(
        images, labels, 10, torch.Generator().manual_seed(0)
    ):
        assert torch.equal(batch_images.flatten(), batch_labels.float()), (
            "images and labels were separated"
        )
        seen += batch_labels.tolist()
    assert sorted(seen) == list(range(103)) and seen != list(range(103))


def test_resident_tensors_match_torchvision_items():
    images, labels = resident_mnist(
        mnist_root(), train=False, device=torch.device("cpu")
    )
    # an independent reader
    reference = datasets.MNIST(root=str(mnist_root()), train=False, download=False)
    assert images.shape == (10_000, 1, 28, 28) and labels.dtype == torch.long
    for index in (0, 1234, 9999):
        pil_image, label = reference[index]
        pixels = torch.from_numpy(np.array(pil_image)).float().view(1, 28, 28) / 255
        # atol 1e-5: the same float32 arithmetic in a different order
        torch.testing.assert_close(
            images[index], (pixels - MNIST_MEAN) / MNIST_STD, atol=1e-5, rtol=0
        )
        assert labels[index] == label


def test_dataset_items_are_the_published_images():
    ours = mnist_dataset(mnist_root(), train=False)
    reference = datasets.MNIST(root=str(mnist_root()), train=False, download=False)
    image, label = ours[42]
    assert (
        np.array_equal(np.array(image), np.array(reference[42][0]))
        and label == reference[42][1]
    )


def test_planted_processed_file_is_never_read(tmp_path):
    copy_test_split(tmp_path)
    processed = tmp_path / "MNIST" / "processed"
    processed.mkdir()
    planted = (
        torch.zeros(10, 28, 28, dtype=torch.uint8),
        torch.zeros(10, dtype=torch.long),
    )
    torch.save(planted, processed / "test.pt")  # torchvision's legacy file names
    torch.save(planted, processed / "training.pt")
    dataset = mnist_dataset(tmp_path, train=False)
    assert len(dataset) == 10_000, (
        f"read {len(dataset)} images, not the 10,000 of the raw files"
    )


def test_truncated_raw_file_is_refused_with_its_path(tmp_path):
    raw = copy_test_split(tmp_path)
    labels = raw / "t10k-labels-idx1-ubyte"
    labels.write_bytes(labels.read_bytes()[:5000])
    with pytest.raises(MnistFormatError, match=r"t10k-labels-idx1-ubyte.*truncated"):
        mnist_dataset(tmp_path, train=False)


def test_foreign_raw_file_is_refused_with_its_path(tmp_path):
    raw = copy_test_split(tmp_path)
    images = raw / "t10k-images-idx3-ubyte"
    # a zip's magic, not IDX's
    images.write_bytes(b"PK\x03\x04" + images.read_bytes()[4:])
    with pytest.raises(
        MnistFormatError, match=r"t10k-images-idx3-ubyte: magic number 504b0304"
    ):
        resident_mnist(tmp_path, train=False, device=torch.device("cpu"))


def test_missing_raw_file_is_refused_with_its_path(tmp_path):
    (tmp_path / "MNIST" / "raw").mkdir(parents=True)
    with pytest.raises(MnistFormatError, match=r"t10k-images-idx3-ubyte: missing"):
        mnist_dataset(tmp_path, train=False)


def test_random_shift_moves_the_image_by_the_drawn_offset():
    image = torch.zeros(1, 28, 28)
    image[0, 14, 14] = 1
    # as a spawned worker gets it
    shift = pickle.loads(pickle.dumps(SlowTransform(RandomShift(2), seconds=0.0)))
    nonzero = 0
    for seed in range(6):
        torch.manual_seed(seed)
        # the offset RandomShift must draw with this seed
        dy, dx = torch.randint(-2, 3, (2,)).tolist()
        torch.manual_seed(seed)
        moved = shift(image)
        assert moved[0, 14 + dy, 14 + dx] == 1 and moved.sum() == 1, (
            f"seed {seed}: not moved by ({dy}, {dx})"
        )
        nonzero += (dy, dx) != (0, 0)
    assert nonzero >= 3, (
        "the seeds chosen drew too few non-zero shifts to test anything"
    )
