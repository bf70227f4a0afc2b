"""The book's optimizer and learning-rate schedule: two-group AdamW, warmup + cosine.

The ``Trainer`` takes any optimizer; this module builds the default one, the
way most LLM training runs set it up. ``OptimizerConfig`` holds what it is
built from, and ``train.TrainConfig`` extends it. The schedule is a plain
function of the step, ``learning_rate(step, config)``, and the ``Trainer``
writes it into every group before each step (``set_learning_rate``), as
nanoGPT does: nothing about the schedule is saved, so a resumed run that
changes the config simply takes the new rate. ``build_schedule`` wraps the
same function in a ``LambdaLR`` for a loop of your own that calls
``scheduler.step()``.

Torch's ``Optimizer.load_state_dict`` checks the number of groups and of
parameters in each, and nothing else. It loads a moment of any shape or
type, a step count that is a string, the state of a parameter the model
does not have, and takes every group setting from the file: a flipped
``amsgrad`` or a malformed moment fails at the next step, a malformed step
count fails half-way through the load itself, a stray parameter's state is
saved again with every later checkpoint, and a state saved without the
fused kernel turns a fused optimizer into one that fails under a loss
scaler. ``optimizer_state_problems`` finds all but the last before anything
is loaded; ``load_optimizer_state`` keeps this machine's implementation
flags (``fused``, ``foreach``), so a checkpoint moves between machines with
and without the fused kernel.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

# Devices with a fused AdamW kernel (one kernel for all parameters, not one per op).
FUSED_DEVICE_TYPES = ("cuda", "cpu", "mps", "xpu")


@dataclass
class OptimizerConfig:
    """What the optimizer and its schedule are built from."""

    max_steps: int = 1000  # optimizer steps of the run; the cosine ends here
    lr: float = 3e-4  # peak learning rate, reached at the end of warmup
    min_lr: float = 3e-5  # learning rate at max_steps, the end of the cosine
    warmup_steps: int = 100  # steps of linear warmup from lr / warmup_steps to lr
    weight_decay: float = 0.1  # applied to weights with dim >= 2 only
    betas: tuple[float, float] = (0.9, 0.95)  # AdamW's moment decay rates

    def __post_init__(self) -> None:
        name = type(self).__name__
        if not isinstance(self.max_steps, int) or self.max_steps < 1:
            raise ValueError(
                f"{name}.max_steps must be a positive int, got {self.max_steps!r}"
            )
        if (
            not isinstance(self.warmup_steps, int)
            or not 0 <= self.warmup_steps <= self.max_steps
        ):
            raise ValueError(
                f"{name}.warmup_steps must be an int "
                f"in [0, max_steps={self.max_steps}], "
                f"got {self.warmup_steps!r}"
            )
        if not 0 <= self.min_lr <= self.lr or self.lr <= 0:
            raise ValueError(
                f"{name} needs 0 <= min_lr <= lr and lr > 0, "
                f"got min_lr={self.min_lr}, lr={self.lr}"
            )


def learning_rate(step: int, config: OptimizerConfig) -> float:
    """Learning rate for the optimizer step that follows ``step`` completed steps.

    Linear warmup (lr / warmup_steps up to lr), then a half cosine down to ``min_lr``
    at ``max_steps``, ``min_lr`` after. Warmup keeps the first updates small while
    AdamW's second moments are poor; the cosine lets the loss settle.
    """
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    if step >= config.max_steps:
        return config.min_lr
    progress = (step - config.warmup_steps) / max(
        1, config.max_steps - config.warmup_steps
    )
    return config.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (
        config.lr - config.min_lr
    )


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: matrices (dim >= 2) decay; biases and norms (dim < 2) do not.

    Decay regularises the matrices that mix features; a LayerNorm gain pulled to
    zero would switch its layer off, and a bias has nothing to regularise. A tied
    weight is yielded once by ``named_parameters``, so it lands in one group.
    """
    trainable = [p for _, p in model.named_parameters() if p.requires_grad]
    return [
        {
            "params": [p for p in trainable if p.dim() >= 2],
            "weight_decay": weight_decay,
        },
        {"params": [p for p in trainable if p.dim() < 2], "weight_decay": 0.0},
    ]


def set_learning_rate(
    optimizer: torch.optim.Optimizer, step: int, config: OptimizerConfig
) -> float:
    """Write ``learning_rate(step, config)`` into every group; return it.

    Called before each optimizer step, this is the whole schedule: no state to
    save, and a resumed run with a changed config uses the new rate at once.
    """
    rate = learning_rate(step, config)
    for group in optimizer.param_groups:
        group["lr"] = rate
    return rate


def build_adamw(
    model: nn.Module, config: OptimizerConfig, device: torch.device | None = None
) -> torch.optim.AdamW:
    """The book's AdamW: decay and no-decay groups, at the first step's rate.

    ``fused=True`` (one kernel for all parameters, not several per operation) where
    the device has the kernel and every parameter is floating point. ``device``
    defaults to the first parameter's.
    """
    groups = parameter_groups(model, config.weight_decay)
    parameters = [p for group in groups for p in group["params"]]
    if device is None:
        device = parameters[0].device if parameters else torch.device("cpu")
    fused = torch.device(device).type in FUSED_DEVICE_TYPES and all(
        p.is_floating_point() for p in parameters
    )
    return torch.optim.AdamW(
        groups, lr=learning_rate(0, config), betas=config.betas, fused=fused or None
    )


def build_schedule(
    optimizer: torch.optim.Optimizer, config: OptimizerConfig
) -> torch.optim.lr_scheduler.LambdaLR:
    """``learning_rate`` as a ``LambdaLR``, for a loop that calls ``scheduler.step()``.

    LambdaLR multiplies each group's rate at construction by the factor, so a
    group built with ``config.lr`` follows ``learning_rate`` exactly.
    """
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: learning_rate(step, config) / config.lr
    )


def build_optimizer(
    model: nn.Module, config: OptimizerConfig, device: torch.device | None = None
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """``build_adamw`` and its ``build_schedule``, for a hand-written loop."""
    optimizer = build_adamw(model, config, device)
    for group in optimizer.param_groups:
        group["lr"] = config.lr  # LambdaLR's base rate
    return optimizer, build_schedule(optimizer, config)


def apply_config(optimizer: torch.optim.Optimizer, config: OptimizerConfig) -> None:
    """Set a loaded ``build_adamw`` optimizer's betas and weight decay to ``config``.

    A loaded state brings the settings it was saved with; a resumed run takes
    its config's. The learning rate needs nothing: it is set before each step.
    """
    decays = (config.weight_decay, 0.0)  # build_adamw's two groups
    for group, decay in zip(optimizer.param_groups, decays, strict=True):
        group["betas"] = tuple(config.betas)
        group["weight_decay"] = decay


# ----- loading a saved state -----

# Param-group settings about how the optimizer runs here, not where training stands.
IMPLEMENTATION_FLAGS = ("foreach", "fused", "capturable", "differentiable")
# Param-group switches that decide a parameter's moments (amsgrad adds max_exp_avg_sq).
STATE_SWITCHES = ("amsgrad",)


def optimizer_state_problems(
    saved: Mapping[str, Any], optimizer: torch.optim.Optimizer
) -> list[str]:
    """Why a saved ``optimizer.state_dict()`` cannot load into ``optimizer``.

    Empty when it fits. Its layout: the number of groups and of parameters in
    each, and the ``STATE_SWITCHES``. Each parameter's state: a parameter
    the groups list, tensors only, the same names as the other parameters of
    its group, and every moment (a tensor with dimensions) of its parameter's
    shape; 0-dim tensors are step counts. Torch checks only the counts: it
    loads anything else, and the next step fails, or it keeps the entry of
    a parameter the model lacks and saves it again with every later state.
    """
    groups = saved.get("param_groups") if isinstance(saved, Mapping) else None
    if not isinstance(groups, list) or not isinstance(saved.get("state"), Mapping):
        return ["optimizer: expected a dict with 'state' and a list of 'param_groups'"]
    if len(groups) != len(optimizer.param_groups):
        return [
            f"optimizer: {len(groups)} parameter groups in the state, "
            f"{len(optimizer.param_groups)} here"
        ]
    problems, shapes, group_of = [], {}, {}
    for number, (group, live) in enumerate(
        zip(groups, optimizer.param_groups, strict=True)
    ):
        if len(group["params"]) != len(live["params"]):
            problems.append(
                f"optimizer group {number}: "
                f"{len(group['params'])} parameters in the state, "
                f"{len(live['params'])} here"
            )
        problems += [
            f"optimizer group {number}: {switch}={group.get(switch)} in the state, "
            f"{live[switch]} here"
            for switch in STATE_SWITCHES
            if switch in live and group.get(switch) != live[switch]
        ]
        shapes.update(
            zip(
                group["params"],
                (parameter.shape for parameter in live["params"]),
                strict=False,  # a group of another size is reported above
            )
        )
        group_of.update(dict.fromkeys(group["params"], number))
    held = {}  # the names each group's parameter states hold, together
    for index, entry in saved["state"].items():
        if index in group_of and isinstance(entry, Mapping):
            held.setdefault(group_of[index], set()).update(entry)
    for index, entry in saved["state"].items():
        where = f"optimizer state of parameter {index!r}"
        if index not in group_of:
            problems.append(
                f"{where}: no such parameter; the state's groups list "
                f"{len(group_of)} parameters"
            )
            continue
        if not isinstance(entry, Mapping):
            problems.append(f"{where}: a {type(entry).__name__}, expected a dict")
            continue
        if missing := sorted(held[group_of[index]] - set(entry)):
            problems.append(
                f"{where}: lacks {missing}, which other parameters of group "
                f"{group_of[index]} hold"
            )
        for name, value in entry.items():
            if not isinstance(value, Tensor):
                problems.append(
                    f"{where}: {name!r} is a {type(value).__name__}, expected a tensor"
                )
            elif value.dim() > 0 and index in shapes and value.shape != shapes[index]:
                problems.append(
                    f"{where}: {name!r} has shape {tuple(value.shape)}, "
                    f"the parameter {tuple(shapes[index])}"
                )
    return problems


def load_optimizer_state(
    optimizer: torch.optim.Optimizer, saved: Mapping[str, Any]
) -> None:
    """Load ``saved`` into ``optimizer``, keeping its own ``IMPLEMENTATION_FLAGS``.

    Torch takes every group setting from the file, so a state saved without the
    fused kernel (``fused=None``) would turn a fused optimizer into one that
    fails at its next step under a loss scaler; the flags stay this machine's.
    """
    groups = [
        {**group, **{flag: now[flag] for flag in IMPLEMENTATION_FLAGS if flag in now}}
        for group, now in zip(
            saved["param_groups"], optimizer.param_groups, strict=True
        )
    ]
    optimizer.load_state_dict({**saved, "param_groups": groups})
