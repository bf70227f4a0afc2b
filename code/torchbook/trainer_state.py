"""The ``Trainer``'s saved state: what it holds, and a saved one parsed whole.

``Trainer.state_dict()`` returns everything that continues a run exactly,
as tensors and plain values, so that ``torch.load(weights_only=True)``
reads it back: the model's and the optimizer's state dicts, the
scheduler's (when one was passed) and the fp16 loss scaler's, the step
and the fp16 steps the scaler skipped, the history, the steps since the
last history row (their losses are still tensors on the device) and the
training configuration. ``TrainerState`` names those fields.

**Parse, then apply.** ``Trainer.load_state_dict`` first turns a saved
state into a ``TrainerState`` with ``parse_trainer_state``, checked
against the trainer it is for, and changes nothing unless every part
fits; applying the parsed state then cannot fail half-way. The checks
are those that PyTorch's own loaders skip or make too late:
``load_state_dict`` copies every tensor that fits before it raises, and
an optimizer loads a malformed state and fails at the next step. Values
inside a state (a learning rate, the numbers in a moment) are the file's:
the checkpoint module states what a file is trusted with.

It builds on ``torchbook.optim`` (the optimizer state's checks) and
``torchbook.state_dicts`` (the model's key, shape and dtype check).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from torchbook.optim import optimizer_state_problems
from torchbook.state_dicts import state_dict_problems


@dataclass
class StepResult:
    """One optimizer step's numbers, as ``Trainer.train_step`` returns them.

    The tensors stay on the device until ``Trainer.log`` reads the steps
    since the last history row all at once (one sync); until then they are
    part of the trainer's state.
    """

    step: int  # the step count after this step (unchanged when it was skipped)
    lr: float  # the learning rate this step used
    loss: Tensor  # mean loss per target token (over all ranks when distributed)
    grad_norm: Tensor  # total gradient norm before clipping
    target_tokens: Tensor  # the step's target tokens (over all ranks if distributed)
    skipped: bool  # the fp16 scaler skipped it; step and schedule did not advance


@dataclass
class TrainerState:
    """A saved ``Trainer.state_dict()``, parsed and checked against a trainer.

    Loading it cannot fail half-way.
    """

    model: dict[str, Tensor]  # keys, shapes and dtypes checked
    optimizer: dict[str, Any]  # groups, parameters, each one's state checked
    scheduler: dict[str, Any]  # {} unless a scheduler was passed
    scaler: dict[str, Any]  # {} without loss scaling (fp32, bf16)
    step: int
    skipped_steps: int
    skips_in_a_row: int  # of fp16 steps, toward train.MAX_SKIPS_IN_A_ROW
    history: list[dict]
    unlogged: list[StepResult]  # the steps since the last history row
    seconds_since_log: float  # of the unlogged steps, for tokens_per_second
    config: dict[str, Any]


def parse_trainer_state(
    state: Mapping[str, Any],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    device: torch.device,
) -> TrainerState:
    """``state`` as a ``TrainerState`` for the trainer of these parts, or a ValueError.

    The ValueError lists every problem found. Checked: exactly
    ``TrainerState``'s fields; the model's keys, shapes and dtypes; the
    optimizer's state (``optimizer_state_problems``: its layout and each
    parameter's tensors); the scaler's fields, and a scheduler present or
    absent as here; the counters as ints >= 0; the rest by type. The
    unlogged steps' tensors are copied to ``device``: applying the result
    can then neither fail nor share a tensor with ``state``.
    """
    names = [field.name for field in dataclasses.fields(TrainerState)]
    if not isinstance(state, Mapping) or set(state) != set(names):
        found = sorted(state) if isinstance(state, Mapping) else type(state).__name__
        raise ValueError(
            f"Trainer.load_state_dict: expected a dict of {', '.join(names)}; "
            f"got {found}"
        )
    weights = state["model"]
    problems = (
        [f"model: {line}" for line in state_dict_problems(model, weights)]
        if isinstance(weights, Mapping)
        else [f"model: a {type(weights).__name__}, expected a dict of tensors"]
    )
    try:
        problems += optimizer_state_problems(state["optimizer"], optimizer)
    # a group that is not a dict, a group without "params", unhashable indices
    except (TypeError, KeyError, AttributeError) as error:
        problems.append(f"optimizer: not an optimizer.state_dict(): {error!r}")
    saved_scaler, expected = state["scaler"], sorted(scaler.state_dict())  # [] if off
    found = (
        sorted(saved_scaler, key=str)
        if isinstance(saved_scaler, dict)
        else type(saved_scaler)
    )
    if found != expected:
        problems.append(f"scaler: keys {found} in the state, {expected} here")
    saved_scheduler, here = state["scheduler"], scheduler is not None
    if not isinstance(saved_scheduler, dict) or bool(saved_scheduler) != here:
        problems.append(f"scheduler: {bool(saved_scheduler)} in the state, {here} here")
    problems += [
        f"{key}: {state[key]!r}, expected an int >= 0"
        for key in ("step", "skipped_steps", "skips_in_a_row")
        if type(state[key]) is not int or state[key] < 0
    ]
    # Copies on this trainer's device: applying them cannot fail or share with state
    try:
        tensors = ("loss", "grad_norm", "target_tokens")
        parsed = {
            "history": [dict(row) for row in state["history"]],
            "unlogged": [
                StepResult(**{**step, **{k: step[k].to(device) for k in tensors}})
                for step in state["unlogged"]
            ],
            "seconds_since_log": float(state["seconds_since_log"]),
            "config": dict(state["config"]),
        }
    except (TypeError, ValueError, KeyError, AttributeError) as error:
        problems.append(f"history, unlogged, seconds_since_log or config: {error}")
    if problems:
        raise ValueError(
            "Trainer.load_state_dict: the state does not fit this trainer; nothing was "
            "loaded:\n  " + "\n  ".join(problems)
        )
    return TrainerState(**{**state, **parsed})
