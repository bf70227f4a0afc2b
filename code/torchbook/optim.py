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
is loaded; ``load_optimizer_state`` then loads it but keeps the live
optimizer's implementation flags (``fused``, ``foreach``), so a checkpoint
moves between machines with and without the fused kernel.
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
    """An int, a float or a 0-dim tensor (not a bool)."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) or (
        isinstance(value, Tensor) and value.dim() == 0)


def structure_problems(saved: Any, live: Any, where: str, *, optional: bool = False) -> list[str]:
    """Where ``saved`` lacks the structure of ``live``: dict keys, list lengths, tensor shapes and dtypes, kinds.

    A live int wants an int, a float an int or a float, a bool a bool, a
    string a string, None None. ``optional`` is for a user's config: there
    ``None`` fits anything and an int and a float stand for each other.
    """
    if optional and (live is None or saved is None):
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
    plain = lambda v, kinds: isinstance(v, kinds) and not isinstance(v, bool)  # noqa: E731
    integer = int if not optional else ()  # in a config an int may stand for a float and the other way round
    for fits, what in ((lambda v: v is None, "None"), (lambda v: isinstance(v, bool), "a bool"),
                       (lambda v: plain(v, integer), "an int"), (lambda v: plain(v, (int, float)), "a number"),
                       (lambda v: isinstance(v, str), "a string")):
        if fits(live):
            return [] if fits(saved) else [f"{where}: {saved!r:.60}, expected {what}"]
    return []


# Param-group settings that say how the optimizer runs on this machine, not where training stands.
IMPLEMENTATION_FLAGS = ("foreach", "fused", "capturable", "differentiable")


def load_optimizer_state(optimizer: torch.optim.Optimizer, saved: Mapping[str, Any]) -> None:
    """``optimizer.load_state_dict(saved)``, keeping this optimizer's ``IMPLEMENTATION_FLAGS``.

    Torch takes every group setting from the file, so a state saved without the
    fused kernel (``fused=None``) would turn a fused optimizer into one that
    fails at its next step under a loss scaler; the flags stay this machine's.
    """
    groups = [{**group, **{flag: now[flag] for flag in IMPLEMENTATION_FLAGS if flag in now}}
              for group, now in zip(saved["param_groups"], optimizer.param_groups)]
    optimizer.load_state_dict({**saved, "param_groups": groups})


# What one value of a parameter's optimizer state can be: a moment, a step count, or nothing.
ENTRY_KINDS = ("shaped", "scalar", "None")


def _entry_kinds(value: Any, parameter: Tensor) -> set[str]:
    """The ``ENTRY_KINDS`` ``value`` may be for ``parameter`` (a 0-dim parameter's moment is also a scalar)."""
    if isinstance(value, Tensor) and value.shape == parameter.shape:
        return {"shaped", "scalar"} if value.dim() == 0 else {"shaped"}
    return {"scalar"} if _is_number(value) else {"None"} if value is None else set()


def optimizer_state_problems(saved: Any, optimizer: torch.optim.Optimizer) -> list[str]:
    """Every way a saved ``optimizer.state_dict()`` does not fit ``optimizer``; empty when it loads.

    The groups must match in number and size, their settings in kind and their
    switches (bools) in value. Within a group every parameter's entry must have
    the same keys, each value the same kind in every entry: a scalar (a step
    count), None, or a tensor of the parameter's shape (a moment).
    """
    groups = [{key: value for key, value in group.items() if key not in IMPLEMENTATION_FLAGS}
              for group in optimizer.state_dict()["param_groups"]]
    problems = structure_problems(saved, {"state": {}, "param_groups": groups}, "optimizer")
    if problems:
        return problems
    # A switch (amsgrad, maximize, nesterov) decides which entries the state holds: it must be this optimizer's.
    problems += [f"optimizer['param_groups'][{number}][{key!r}]: {group[key]} in the state, {value} in this "
                 "optimizer, which was built with other settings"
                 for number, (group, now) in enumerate(zip(saved["param_groups"], groups))
                 for key, value in now.items() if isinstance(value, bool) and group[key] != value]
    state, shapes = saved["state"], {}
    for group, now in zip(saved["param_groups"], optimizer.param_groups):
        kinds: dict[str, dict[int, set[str]]] = {}  # key -> parameter -> what its value may be
        for index, parameter in zip(group["params"], now["params"]):
            shapes[index] = tuple(parameter.shape)
            entry = state.get(index, {})
            if not isinstance(entry, Mapping):
                problems.append(f"optimizer['state'][{index!r}]: a {type(entry).__name__}, expected a dict")
                continue
            for name, value in entry.items():
                kinds.setdefault(name, {})[index] = _entry_kinds(value, parameter)
        entries = [index for index in group["params"] if isinstance(state.get(index), Mapping) and state[index]]
        for name, found in kinds.items():
            # The kind most entries allow; on a tie a moment (parameter-shaped) wins over a scalar, then None.
            usual = max(ENTRY_KINDS, key=lambda kind: (sum(kind in allowed for allowed in found.values()),
                                                       -ENTRY_KINDS.index(kind)))
            problems += [f"optimizer['state'][{index!r}]: no {name!r}, which the group's other entries have"
                         for index in entries if name not in state[index]]
            expected = {"shaped": "a tensor of shape {}", "scalar": "a scalar", "None": "None"}[usual]
            problems += [f"optimizer['state'][{index!r}][{name!r}]: {state[index][name]!r:.40}, expected "
                         + expected.format(shapes[index]) for index, allowed in found.items() if usual not in allowed]
    problems += [f"optimizer['state'][{index!r}]: a parameter the groups do not hold" for index in state
                 if index not in shapes]
    return problems
