"""Helpers for the checkpoint and weights tests: copy tensors, compare bit for bit."""

from __future__ import annotations

import torch
from torch import nn


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of every tensor in ``model.state_dict()``, to compare later."""
    return {
        name: tensor.detach().clone() for name, tensor in model.state_dict().items()
    }


def assert_same_tensors(
    left: dict[str, torch.Tensor], right: dict[str, torch.Tensor]
) -> None:
    """The same names, and every tensor equal bit for bit (values, shape and dtype)."""
    assert left.keys() == right.keys()
    for name in left:
        assert torch.equal(left[name], right[name]), f"{name} differs"
