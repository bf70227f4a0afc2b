"""The book's optimizer and learning-rate schedule: AdamW in two groups, warmup + cosine.

The ``Trainer`` takes any optimizer and scheduler; this module builds the
default one, the way most LLM training runs set it up. ``OptimizerConfig``
holds what they are built from, and ``train.TrainConfig`` extends it.
``apply_config`` sets an already loaded optimizer and schedule to a config,
which is how a resumed run takes a changed learning rate.

Torch's ``Optimizer.load_state_dict`` and ``LRScheduler.load_state_dict``
accept any value (a string learning rate, moments of another shape, a
schedule without ``last_epoch``) and fail, or silently mis-train, a step
later. ``optimizer_state_problems`` and ``structure_problems`` check a saved
state against the live one first, so a bad state is refused before anything
is loaded.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

# Devices with a fused AdamW kernel (one kernel for all parameters instead of one per operation).
FUSED_DEVICE_TYPES = ("cuda", "cpu", "mps", "xpu")
LISTED_KEYS = 12  # a problem lists at most this many missing keys


@dataclass
class OptimizerConfig:
    """What the optimizer and its schedule are built from."""

    max_steps: int = 1000  # optimizer steps that fit() runs; the cosine ends here
    lr: float = 3e-4  # peak learning rate, reached at the end of warmup
    min_lr: float = 3e-5  # learning rate at max_steps, the end of the cosine
    warmup_steps: int = 100  # steps of linear warmup from lr / warmup_steps to lr
    weight_decay: float = 0.1  # applied to weights with dim >= 2 only
    betas: tuple[float, float] = (0.9, 0.95)  # AdamW's moment decay rates

    def __post_init__(self) -> None:
        name = type(self).__name__
        if not isinstance(self.max_steps, int) or self.max_steps < 1:
            raise ValueError(f"{name}.max_steps must be a positive int, got {self.max_steps!r}")
        if not isinstance(self.warmup_steps, int) or not 0 <= self.warmup_steps <= self.max_steps:
            raise ValueError(f"{name}.warmup_steps must be an int in [0, max_steps={self.max_steps}], "
                             f"got {self.warmup_steps!r}")
        if not 0 <= self.min_lr <= self.lr or self.lr <= 0:
            raise ValueError(f"{name} needs 0 <= min_lr <= lr and lr > 0, got min_lr={self.min_lr}, lr={self.lr}")


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
    progress = (step - config.warmup_steps) / max(1, config.max_steps - config.warmup_steps)
    return config.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (config.lr - config.min_lr)


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: matrices (dim >= 2) decay; biases and norm weights (dim < 2) do not.

    Decay regularises the matrices that mix features; a LayerNorm gain pulled to
    zero would switch its layer off, and a bias has nothing to regularise. A tied
    weight is yielded once by ``named_parameters``, so it lands in one group.
    """
    trainable = [p for _, p in model.named_parameters() if p.requires_grad]
    return [
        {"params": [p for p in trainable if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in trainable if p.dim() < 2], "weight_decay": 0.0},
    ]


def build_schedule(optimizer: torch.optim.Optimizer, config: OptimizerConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """Warmup + cosine (``learning_rate``) as a ``LambdaLR``: each group's lr times ``learning_rate / config.lr``."""
    def lr_factor(step: int) -> float:  # LambdaLR multiplies each group's base lr by this
        return learning_rate(step, config) / config.lr

    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)


def build_optimizer(model: nn.Module, config: OptimizerConfig, device: torch.device | None = None
                    ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """The book's AdamW (decay and no-decay groups) and its warmup + cosine schedule.

    ``fused=True`` (one kernel for all parameters, not several per operation) where
    the device has the kernel and every parameter is floating point. ``device``
    defaults to the first parameter's.
    """
    groups = parameter_groups(model, config.weight_decay)
    parameters = [p for group in groups for p in group["params"]]
    if device is None:
        device = parameters[0].device if parameters else torch.device("cpu")
    fused = torch.device(device).type in FUSED_DEVICE_TYPES and all(p.is_floating_point() for p in parameters)
    optimizer = torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, fused=fused or None)
    return optimizer, build_schedule(optimizer, config)


def apply_config(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR,
                 config: OptimizerConfig) -> None:
    """Set a loaded ``build_optimizer`` pair to ``config``, as if built with it and stepped ``last_epoch`` times.

    A loaded ``LambdaLR`` keeps the saved base rates while its factor comes from
    the new config; this sets both, so the next step uses ``learning_rate(step,
    config)``. With the config the state was saved with, every value is the
    loaded one, bit for bit.
    """
    for group, decay in zip(optimizer.param_groups, (config.weight_decay, 0.0)):
        group["initial_lr"] = config.lr
        group["betas"] = tuple(config.betas)
        group["weight_decay"] = decay
    scheduler.base_lrs = [config.lr for _ in optimizer.param_groups]
    # LambdaLR's own formula at last_epoch, so the schedule's next steps continue from it.
    rates = [base * factor(scheduler.last_epoch) for base, factor in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, rate in zip(optimizer.param_groups, rates):
        group["lr"] = rate
    scheduler._last_lr = rates


# ----- checking a saved state before loading it -----


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float, Tensor)) and not isinstance(value, bool)


def structure_problems(saved: Any, live: Any, where: str, *, optional: bool = False) -> list[str]:
    """Where ``saved`` lacks the structure of ``live``: dict keys, list lengths, tensor shapes and dtypes, kinds.

    A live number accepts an int, a float or a tensor, never a bool or a string.
    ``None`` fits where ``live`` is None, stands for a bool (torch's tri-state
    flags ``fused`` and ``foreach``), and for anything with ``optional``.
    """
    if live is None or (saved is None and (optional or isinstance(live, bool))):
        return []
    if isinstance(live, Mapping):
        if not isinstance(saved, Mapping):
            return [f"{where}: a {type(saved).__name__}, expected a dict"]
        missing = [key for key in live if key not in saved]
        problems = [f"{where}: {len(missing)} missing keys: {missing[:LISTED_KEYS]}"] if missing else []
        return problems + [line for key in live if key in saved for line in
                           structure_problems(saved[key], live[key], f"{where}[{key!r}]", optional=optional)]
    if isinstance(live, (list, tuple)):
        if not isinstance(saved, (list, tuple)) or len(saved) != len(live):
            found = f"a list of {len(saved)}" if isinstance(saved, (list, tuple)) else f"{saved!r:.60}"
            return [f"{where}: {found}, expected a list of {len(live)}"]
        return [line for index, (item, model) in enumerate(zip(saved, live))
                for line in structure_problems(item, model, f"{where}[{index}]", optional=optional)]
    if isinstance(live, Tensor):
        if isinstance(saved, Tensor) and saved.shape == live.shape and saved.dtype == live.dtype:
            return []
        found = f"{saved.dtype} {tuple(saved.shape)}" if isinstance(saved, Tensor) else type(saved).__name__
        return [f"{where}: {found}, expected {live.dtype} {tuple(live.shape)}"]
    for kind, what in ((lambda v: isinstance(v, bool), "a bool"), (_is_number, "a number"),
                       (lambda v: isinstance(v, str), "a string")):
        if kind(live) and not kind(saved):
            return [f"{where}: {saved!r:.60}, expected {what}"]
    return []


def optimizer_state_problems(saved: Any, optimizer: torch.optim.Optimizer) -> list[str]:
    """Every way a saved ``optimizer.state_dict()`` does not fit ``optimizer``; empty when it loads.

    The groups must match in number, size and the kinds of their settings; each
    per-parameter entry (moments, step counts) must belong to a parameter of the
    groups and have its shape, or be a number.
    """
    live = {"state": {}, "param_groups": optimizer.state_dict()["param_groups"]}
    problems = structure_problems(saved, live, "optimizer")
    if problems:
        return problems
    shapes = {old: new.shape for group, now in zip(saved["param_groups"], optimizer.param_groups)
              for old, new in zip(group["params"], now["params"])}
    for index, entries in saved["state"].items():
        if index not in shapes or not isinstance(entries, Mapping):
            problems.append(f"optimizer['state'][{index!r}]: expected a dict for a parameter of the groups")
            continue
        problems += [f"optimizer['state'][{index!r}][{name!r}]: {value!r:.40}, expected a number or a tensor "
                     f"of shape {tuple(shapes[index])}" for name, value in entries.items()
                     if not _is_number(value) or (isinstance(value, Tensor) and value.dim() > 0
                                                  and value.shape != shapes[index])]
    return problems
