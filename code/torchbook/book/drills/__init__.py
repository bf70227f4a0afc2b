"""The checkers of ``pytorch_drills.ipynb``, the lab's exercise notebook.

Each drill's checker recomputes what it can from the objects an answer leaves
(the model, the optimizer, the generator that shuffled the epochs, the files)
rather than trusting the numbers it reports, and raises ``DrillCheckError``
listing everything that is wrong, each problem with its likely cause. A checker
changes nothing it is given, so a refused answer can be fixed and checked again.

The checkers divide where the drills do:

- ``torchbook.book.drills.training``: drills 1 to 4, which train (the loop,
  ``torch.compile`` timed on training steps, SGD against AdamW, gradient
  accumulation). Their checkers repeat what they can of the run: the epochs its
  generator shuffled, the steps drill 4 compares.
- ``torchbook.book.drills.after_training``: drills 5 to 7, which take drill 1's
  trained model: evaluated under bf16 autocast, saved and reloaded, written as
  safetensors. Their checkers read the files as a loader does.
- ``torchbook.book.drills.notebook``: ``check(N, globals())``, what the
  notebook's check cells call. It finds the names drill N's checker takes, says
  which are still missing, and prints the verdict instead of raising it, so that
  "Run All" reaches the end.

This module holds what they share: the error, the one way a list of problems
becomes it, and two comparisons (a model's test accuracy, two state dicts). It
builds on ``torchbook.book.lab`` for the evaluation.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from torchbook.book.lab import eval_logits


class DrillCheckError(AssertionError):
    """A drill's answer is wrong; the message lists every problem found."""


def fail_if(problems: list[str], drill: int) -> None:
    """Raise ``DrillCheckError`` with every problem, if there is one."""
    if problems:
        raise DrillCheckError(f"drill {drill}: " + "; ".join(problems))


def test_accuracy(model: nn.Module, images: Tensor, labels: Tensor) -> float:
    """The fraction of ``images`` the model classifies as ``labels``, in eval mode."""
    return (eval_logits(model, images).argmax(dim=1) == labels).float().mean().item()


def same_tensors(first: Mapping[str, Tensor], second: Mapping[str, Tensor]) -> bool:
    """Whether two state dicts hold equal tensors under the same names."""
    return first.keys() == second.keys() and all(
        torch.equal(first[name].cpu(), second[name].cpu()) for name in first
    )
