"""What every drill of the lab shares: MNIST as resident tensors, the 784-256-128-10 MLP, and its evaluation.

Chapter 8 writes each drill's own code (the training loop, the compile
timing, accumulation, autocast, saving) in its cells; ``examples/gpu_results.py``
reruns the drills at full size. Both start here: the data on the training
device, the model built from a seed, and the test accuracy and loss measured
in eval mode without gradients.

It builds on ``torchbook.mnist`` (reading the verified raw files) and
``torchbook.download`` (where those files are).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torchbook.download import mnist_root
from torchbook.mnist import resident_mnist


@dataclass
class MnistTensors:
    """The whole of MNIST, normalized, resident on the training device."""

    train_images: Tensor
    train_labels: Tensor
    test_images: Tensor
    test_labels: Tensor


def load_data(device: torch.device) -> MnistTensors:
    """Both splits from the verified raw files, as tensors on ``device``."""
    train = resident_mnist(mnist_root(), train=True, device=device)
    test = resident_mnist(mnist_root(), train=False, device=device)
    return MnistTensors(*train, *test)


class MLP(nn.Module):
    """Flatten a 28x28 image, then Linear + ReLU per hidden width, then a Linear to 10 logits."""

    def __init__(
        self,
        hidden: tuple[int, ...] = (256, 128),
        inputs: int = 28 * 28,
        classes: int = 10,
    ) -> None:
        super().__init__()
        widths = (inputs, *hidden)
        layers: list[nn.Module] = [nn.Flatten()]
        for width_in, width_out in pairwise(widths):
            layers += [nn.Linear(width_in, width_out), nn.ReLU()]
        layers.append(nn.Linear(widths[-1], classes))
        self.layers = nn.Sequential(*layers)

    def forward(self, images: Tensor) -> Tensor:
        return self.layers(images)


def fresh_model(hidden: tuple[int, ...], seed: int, device: torch.device) -> MLP:
    """The MLP initialised from ``seed``: runs that should start from the same weights do."""
    torch.manual_seed(seed)
    return MLP(hidden).to(device)


@torch.no_grad()
def test_logits(
    model: nn.Module, images: Tensor, autocast_dtype: torch.dtype | None = None
) -> Tensor:
    """The model's float32 logits for ``images``, in eval mode, under autocast when a dtype is given."""
    was_training = model.training
    model.eval()
    with torch.autocast(
        images.device.type,
        dtype=autocast_dtype or torch.float32,
        enabled=autocast_dtype is not None,
    ):
        logits = model(images).float()
    model.train(was_training)
    return logits


def evaluate(
    model: nn.Module,
    images: Tensor,
    labels: Tensor,
    autocast_dtype: torch.dtype | None = None,
) -> tuple[float, float]:
    """Test accuracy and mean cross-entropy loss (the loss in float32 even under autocast)."""
    logits = test_logits(model, images, autocast_dtype)
    accuracy = (logits.argmax(dim=1) == labels).float().mean().item()
    return accuracy, F.cross_entropy(logits, labels).item()
