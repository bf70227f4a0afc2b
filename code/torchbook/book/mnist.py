"""MNIST two ways: a ``Dataset`` of PIL images, and the whole set as resident tensors.

MNIST is 60,000 training and 10,000 test images of 28x28 bytes, 55 MB as
bytes: it fits in memory many times over. Decoding each image into a PIL image
and back into a tensor on every epoch (what a ``DataLoader`` with ``ToTensor``
does) costs far more than a small model on it; keeping the normalized tensors
resident and indexing a shuffled permutation makes an epoch a handful of
tensor ops.

Both read only the four published files in ``<root>/MNIST/raw`` (pass
``torchbook.book.download.mnist_root()``, which checks their SHA-256 first). Unlike
``torchvision.datasets.MNIST``, nothing here looks at ``MNIST/processed/``: a
pickled ``training.pt`` found there has been verified by nobody, so it is
never read. A raw file whose header or size is not MNIST's is refused with an
error naming the file.

Also here, so DataLoader workers can pickle them under ``spawn``: transforms
used in the book's DataLoader demonstrations.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

MNIST_MEAN = 0.1307  # mean pixel of the training images, scaled to [0, 1]
MNIST_STD = 0.3081
IMAGE_SIDE = 28
NUM_CLASSES = 10
# The published files: (images, labels, number of examples) per split.
RAW_FILES = {
    True: ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", 60_000),
    False: ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte", 10_000),
}
IDX_UBYTE = 0x08  # the IDX type code for unsigned bytes


class MnistFormatError(ValueError):
    """A raw MNIST file is missing, truncated or not in the IDX format MNIST uses."""


def read_idx(path: Path, expected_shape: tuple[int, ...]) -> torch.Tensor:
    """Read an IDX file of unsigned bytes (MNIST's format) of shape ``expected_shape``.

    The header is a 4-byte magic number (two zero bytes, the type code 0x08
    and the number of dimensions), then each dimension as a big-endian int32,
    then the bytes themselves.
    """
    path = Path(path)
    if not path.is_file():
        raise MnistFormatError(
            f"{path}: missing; expected the published MNIST file there"
        )
    data = path.read_bytes()
    ndim = len(expected_shape)
    header_bytes = 4 + 4 * ndim
    if len(data) < header_bytes:
        raise MnistFormatError(
            f"{path}: {len(data)} bytes, shorter than an IDX header of {header_bytes}"
        )
    magic = data[:4]
    if magic != bytes([0, 0, IDX_UBYTE, ndim]):
        raise MnistFormatError(
            f"{path}: magic number {magic.hex()}, "
            f"expected {bytes([0, 0, IDX_UBYTE, ndim]).hex()} "
            f"(unsigned bytes, {ndim} dimensions)"
        )
    shape = tuple(
        int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)
    )
    if shape != expected_shape:
        raise MnistFormatError(
            f"{path}: header says shape {shape}, expected {expected_shape}"
        )
    expected_bytes = header_bytes + int(np.prod(shape))
    if len(data) != expected_bytes:
        raise MnistFormatError(
            f"{path}: {len(data):,} bytes, "
            f"expected {expected_bytes:,} for shape {shape}; "
            "was the file truncated?"
        )
    array = np.frombuffer(data, dtype=np.uint8, offset=header_bytes).reshape(shape)
    return torch.from_numpy(array.copy())


def read_mnist(root: Path | str, train: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Images (uint8, ``(N, 28, 28)``) and labels (int64) from ``<root>/MNIST/raw``."""
    images_name, labels_name, count = RAW_FILES[bool(train)]
    raw = Path(root) / "MNIST" / "raw"
    images = read_idx(raw / images_name, (count, IMAGE_SIDE, IMAGE_SIDE))
    labels = read_idx(raw / labels_name, (count,)).long()
    if labels.max().item() >= NUM_CLASSES:
        raise MnistFormatError(
            f"{raw / labels_name}: a label is {labels.max().item()}, expected 0-9"
        )
    return images, labels


class MnistImages(Dataset):
    """MNIST as torchvision serves it: item ``i`` is a ``(PIL image, int label)`` pair.

    ``transform``, when given, is applied to the image. ``data`` (uint8) and
    ``targets`` (int64) hold the whole split, as in torchvision's class, for code
    that wants the tensors.
    """

    def __init__(
        self, root: Path | str, train: bool, transform: Callable | None = None
    ) -> None:
        self.data, self.targets = read_mnist(root, train)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int):
        # uint8 (28, 28): a greyscale "L" image
        image = Image.fromarray(self.data[index].numpy())
        if self.transform is not None:
            image = self.transform(image)
        return image, int(self.targets[index])


def mnist_dataset(
    root: Path | str, train: bool, transform: Callable | None = None
) -> MnistImages:
    """MNIST from the raw files in ``root/MNIST/raw``; never downloads."""
    return MnistImages(root, train, transform)


def resident_mnist(
    root: Path | str, train: bool, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalized float32 images ``(N, 1, 28, 28)`` and int64 labels on ``device``."""
    images, labels = read_mnist(root, train)
    images = (
        images.to(device=device, dtype=torch.float32).div_(255) - MNIST_MEAN
    ) / MNIST_STD
    return images.unsqueeze(1), labels.to(device)


def resident_batches(
    images: torch.Tensor,
    labels: torch.Tensor,
    batch_size: int,
    generator: torch.Generator | None = None,
    drop_last: bool = False,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """One shuffled epoch of ``(images, labels)`` batches by indexing.

    The last batch is smaller unless ``drop_last`` drops it (every step the
    same shape, which spares ``torch.compile`` a recompilation).
    """
    order = torch.randperm(len(images), generator=generator, device="cpu").to(
        images.device
    )
    end = len(images) - len(images) % batch_size if drop_last else len(images)
    for start in range(0, end, batch_size):
        index = order[start : start + batch_size]
        # index_select copies whole rows; images[index] takes the general
        # advanced-indexing path, several times slower
        yield images.index_select(0, index), labels.index_select(0, index)


class SlowTransform:
    """Wrap a transform and wait ``seconds`` per item, like slow decoding or reads.

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
    """Shift a ``(1, H, W)`` image up to ``pixels`` each way, at random (torch's RNG).

    DataLoader seeds torch's RNG in each worker from its base seed plus the
    worker id, so the shifts differ across workers and repeat when the
    loader's ``generator`` is seeded.
    """

    def __init__(self, pixels: int) -> None:
        self.pixels = pixels

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        dy, dx = torch.randint(-self.pixels, self.pixels + 1, (2,)).tolist()
        return torch.roll(image, shifts=(dy, dx), dims=(1, 2))
