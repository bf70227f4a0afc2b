"""The book's training loop: one optimizer step, written out in named parts.

A step over ``accum_steps`` micro-batches counts the target tokens, runs the
forward under ``torch.autocast`` with the loss in float32 (summed over tokens
and divided by the step's count: the gradient of the *mean* loss over the whole
step), backpropagates through the fp16 loss scaler, clips, steps, advances the
schedule and zeroes the gradients; the numbered comments follow that order.
Losses stay on the device and are read to the host (a sync) only every
``log_every`` steps, when a ``history`` row is written; a non-finite loss is
noticed then, and the error names the step where it started. In fp16 the step
also reads the loss scale, to know whether the scaler skipped it.

**The step is the API.** ``Trainer.train_step(micro_batches)`` is what every
script calls, each inside a short loop of its own: ``charlm.train_char_lm``
validates every few steps with ``add_val_loss``, ``examples/resume_demo.py``
saves every few steps, ``examples/train_ddp.py`` counts all-reduces.

The ``Trainer`` owns the training state: ``state_dict()`` holds tensors and
plain values (``torch.load(..., weights_only=True)`` reads it), and
``load_state_dict`` parses all of it into a ``TrainerState`` before changing
anything, so that loading cannot fail half-way. It builds on
``torchbook.optim`` (the default optimizer and schedule, the optimizer's
layout check) and ``torchbook.state_dicts`` (the model inside a compile or DDP
wrapper, and its key/shape check).

**Distributed.** With more than one rank the model must be DDP or FSDP2, which
*average* gradients: the step all-reduces the token count, scales each loss by
the world size (the gradient of the global mean, however tokens fall per rank)
and synchronises gradients on the last micro-batch only. ``state_dict`` suits
one process or DDP; FSDP2's sharded weights need ``torch.distributed.checkpoint``.
The loop draws no random numbers: the caller seeds initialisation, dropout and data.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from torchbook.device import AUTOCAST_DTYPES
from torchbook.optim import (
    OptimizerConfig,
    apply_config,
    build_optimizer,
    build_schedule,
    load_optimizer_state,
    optimizer_layout_problems,
)
from torchbook.state_dicts import state_dict_problems, unwrap_model

# Targets equal to this are not scored (padding, prompt tokens): cross_entropy's own default.
IGNORE_INDEX = -100
Batch = tuple[Tensor, Tensor]  # (inputs, targets)


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or infinite (fp32 or bf16, where nothing skips the step)."""


@dataclass
class TrainConfig(OptimizerConfig):
    """Everything the loop needs to know besides the model and the data.

    The first six fields (``max_steps``, ``lr``, ``min_lr``, ``warmup_steps``,
    ``weight_decay``, ``betas``) come from ``OptimizerConfig``: the default
    optimizer and schedule are built from them.
    """

    accum_steps: int = 1  # micro-batches per optimizer step
    max_grad_norm: float | None = (
        1.0  # clip the total gradient norm to this; None: no clipping
    )
    precision: str = (
        "fp32"  # "fp32" | "bf16" | "fp16" (autocast dtype of the forward pass)
    )
    log_every: int = 10  # steps between history rows, i.e. between host syncs

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.precision not in AUTOCAST_DTYPES:
            raise ValueError(
                f"TrainConfig.precision must be one of {sorted(AUTOCAST_DTYPES)}, got {self.precision!r}"
            )
        for name in ("accum_steps", "log_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"TrainConfig.{name} must be a positive int, got {value!r}"
                )
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ValueError(
                f"TrainConfig.max_grad_norm must be > 0 or None, got {self.max_grad_norm}"
            )


@dataclass
class StepResult:
    """One optimizer step's numbers, as ``train_step`` returns them; the tensors stay on the device.

    The steps since the last history row wait in this form until ``log`` reads them all at once (one sync).
    """

    step: int  # the step count after this step (unchanged when it was skipped)
    lr: float  # the learning rate this step used
    loss: Tensor  # mean loss over the step's target tokens (global across ranks when distributed)
    grad_norm: Tensor  # total gradient norm before clipping
    target_tokens: (
        Tensor  # the step's target-token count (global across ranks when distributed)
    )
    skipped: bool  # True when the fp16 scaler skipped the step (step and schedule did not advance)


@dataclass
class TrainerState:
    """A saved ``Trainer.state_dict()``, parsed and checked against a trainer: loading it cannot fail half-way."""

    model: dict[str, Tensor]  # keys, shapes and dtypes checked
    # layout checked: groups, parameters, amsgrad, moment shapes
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]
    # empty when loss scaling is off (fp32, bf16); must match this trainer
    scaler: dict[str, Any]
    step: int
    skipped_steps: int
    history: list[dict]
    unlogged: list[StepResult]  # the steps since the last history row
    seconds_since_log: float  # of the unlogged steps, for tokens_per_second
    config: dict[str, Any]


def summed_loss(model: nn.Module, x: Tensor, y: Tensor, precision: str) -> Tensor:
    """The forward under autocast in ``precision``, then cross-entropy *summed* over ``y``'s target tokens.

    The loss is taken outside autocast, on logits cast to float32: log-softmax over a large vocabulary
    loses digits in bf16/fp16. A sum, so that the step divides by the token count of all its micro-batches.
    """
    with torch.autocast(
        x.device.type, dtype=AUTOCAST_DTYPES[precision], enabled=precision != "fp32"
    ):
        logits = model(x)
    return F.cross_entropy(
        logits.float().flatten(0, -2),
        y.flatten(),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _check_model(model: nn.Module, device: torch.device) -> None:
    """Raise unless every tensor of ``model`` is on ``device`` (where AdamW creates its moments) and, with
    several ranks, the model is DDP or FSDP (which average gradients over the ranks)."""
    for name, tensor in itertools.chain(
        model.named_parameters(), model.named_buffers()
    ):
        if tensor.device.type != device.type or device.index not in (
            None,
            tensor.device.index,
        ):
            raise ValueError(
                f"Trainer: model tensor {name!r} is on {tensor.device}, expected {device}; "
                f"call model.to({str(device)!r}) before building the Trainer"
            )
    if _world_size() > 1 and not (
        hasattr(model, "no_sync") or hasattr(model, "set_requires_gradient_sync")
    ):
        raise ValueError(
            f"Trainer: torch.distributed runs {_world_size()} ranks but {type(model).__name__} is "
            "neither DDP nor FSDP; wrap the model so that its gradients are averaged over the ranks"
        )


class Trainer:
    """Trains ``model`` (inputs -> logits) with clipping, mixed precision and a learning-rate schedule.

    ``optimizer`` and ``scheduler`` default to ``build_optimizer``'s (a passed optimizer alone gets its
    schedule). ``step`` counts optimizer steps (fp16 steps the scaler skipped count in ``skipped_steps``);
    ``history`` has a row per logged step: ``step``, ``loss``, ``lr``, ``grad_norm``, ``tokens_per_second``.
    """

    def __init__(
        self,
        model: nn.Module,
        config: TrainConfig,
        device: torch.device | str,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    ) -> None:
        device = torch.device(device)
        _check_model(model, device)
        if scheduler is not None and optimizer is None:
            raise ValueError(
                "Trainer: a scheduler was passed without its optimizer; pass both"
            )
        self.model, self.config, self.device = model, config, device
        # built from config, so load_state_dict sets it to config
        self.owns_optimizer = optimizer is None
        if optimizer is None:
            optimizer, scheduler = build_optimizer(model, config, device)
        elif scheduler is None:
            scheduler = build_schedule(optimizer, config)
        self.optimizer, self.scheduler = optimizer, scheduler
        # Loss scaling only for fp16, whose narrow exponent range flushes small gradients to zero.
        self.scaler = torch.amp.GradScaler(
            device.type, enabled=config.precision == "fp16"
        )
        self.step, self.skipped_steps = 0, 0
        self.history: list[dict] = []
        self._unlogged: list[StepResult] = []  # steps not yet in history
        self._interval_started = time.perf_counter()

    # ----- one optimizer step, in its named parts -----

    def _gradient_sync(self, last: bool) -> contextlib.AbstractContextManager:
        """Context for one micro-batch's backward: synchronise gradients over ranks on the last one only."""
        if hasattr(self.model, "set_requires_gradient_sync"):  # FSDP2
            self.model.set_requires_gradient_sync(last)
        elif not last and hasattr(self.model, "no_sync"):  # DDP
            return self.model.no_sync()
        return contextlib.nullcontext()

    def accumulate_gradients(
        self, micro_batches: Sequence[Batch]
    ) -> tuple[Tensor, Tensor]:
        """Parts 1-3 over ``micro_batches``; returns (mean loss, target tokens) as device tensors.

        Dividing each summed loss by the token count of *all* micro-batches makes
        the accumulated gradient exactly one big batch's, however the sizes and
        ignored tokens are spread.
        """
        batches = [
            (x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True))
            for x, y in micro_batches
        ]
        world_size = _world_size()
        # 1. count: a tensor on the device, so no sync; summed over ranks when distributed.
        target_tokens = sum((y != IGNORE_INDEX).sum() for _, y in batches)
        if world_size > 1:
            dist.all_reduce(target_tokens, op=dist.ReduceOp.SUM)
        # at least 1, so an all-ignored step gives loss 0
        target_tokens = target_tokens.clamp(min=1)
        step_loss = torch.zeros((), device=self.device)
        self.model.train()
        for index, (x, y) in enumerate(batches):
            with self._gradient_sync(last=index == len(batches) - 1):
                # 2. forward in low precision, loss in float32, divided by the whole step's token count.
                loss = (
                    summed_loss(self.model, x, y, self.config.precision) / target_tokens
                )
                # 3. backward; gradients add up in .grad across micro-batches. DDP/FSDP average
                #    over ranks, so times world_size gives the sum: the global mean's gradient.
                self.scaler.scale(
                    loss * world_size if world_size > 1 else loss
                ).backward()
            step_loss += loss.detach()
        if world_size > 1:
            # each rank's share of the global mean
            dist.all_reduce(step_loss, op=dist.ReduceOp.SUM)
        return step_loss, target_tokens

    def clip_gradients(self) -> Tensor:
        """Part 4: unscale (fp16: a scaled norm is ``scale`` times too large), then clip; returns the norm before.

        Without ``max_grad_norm`` the clip is at infinity: every gradient is multiplied by exactly 1.0, and the
        norm is still measured for the history.
        """
        self.scaler.unscale_(self.optimizer)
        parameters = [
            p for group in self.optimizer.param_groups for p in group["params"]
        ]
        norm = torch.nn.utils.clip_grad_norm_(
            parameters, self.config.max_grad_norm or math.inf
        )
        # FSDP2 returns the norm as a replicated DTensor; the whole value is on every rank.
        return (
            norm.full_tensor().detach()
            if hasattr(norm, "full_tensor")
            else norm.detach()
        )

    def train_step(self, micro_batches: Sequence[Batch]) -> StepResult:
        """One optimizer step over ``micro_batches`` (usually ``accum_steps``); a step the fp16 scaler skips counts
        in ``skipped_steps``, not ``step``."""
        if len(micro_batches) == 0:
            raise ValueError(
                "Trainer.train_step: got no micro-batches; a step needs at least one"
            )
        # GradScaler halves its scale exactly when it skips a step, which must advance neither the step count
        # nor the schedule. Reading the scale is a host sync, so it is read only with the fp16 scaler on; here,
        # before this step's work is queued, the read waits for nothing (the previous step's emptied the queue).
        scale_before = self.scaler.get_scale() if self.scaler.is_enabled() else None
        step_loss, target_tokens = self.accumulate_gradients(micro_batches)
        grad_norm = self.clip_gradients()
        # the rate this step uses, before the schedule moves it
        lr = self.optimizer.param_groups[0]["lr"]
        # 5. step (skipped by the scaler if an fp16 gradient is inf/nan), then update the scale.
        #    The book's fused AdamW takes the scaler's inf check on the device: no .item() in scaler.step.
        self.scaler.step(self.optimizer)
        self.scaler.update()
        # fp16: waits for the step
        skipped = scale_before is not None and self.scaler.get_scale() < scale_before
        # 6. schedule: the next step's learning rate; a skipped step does not advance it.
        if not skipped:
            self.scheduler.step()
        # 7. zero: None instead of a tensor of zeros; the next backward writes instead of adding.
        self.optimizer.zero_grad(set_to_none=True)
        if skipped:
            self.skipped_steps += 1
            return StepResult(
                self.step, float(lr), step_loss, grad_norm, target_tokens, skipped=True
            )
        self.step += 1
        result = StepResult(
            self.step, float(lr), step_loss, grad_norm, target_tokens, skipped=False
        )
        self._unlogged.append(result)
        if self.step % self.config.log_every == 0:
            self.log()
        return result

    def log(self) -> dict | None:
        """Read the steps since the last row to the host (a sync) and append a row (None: no step since);
        a non-finite loss raises ``NonFiniteLossError`` naming its step."""
        steps, now = self._unlogged, time.perf_counter()
        if not steps:
            return None
        losses, norms, tokens = (
            torch.stack([getattr(step, name) for step in steps]).tolist()
            for name in ("loss", "grad_norm", "target_tokens")
        )
        bad = next(
            (
                step
                for step, loss in zip(steps, losses, strict=True)
                if not math.isfinite(loss)
            ),
            None,
        )
        if bad is not None:
            raise NonFiniteLossError(
                f"training loss is {bad.loss.item()} at optimizer step {bad.step} (noticed at step {steps[-1].step}, "
                f"when the losses were read); precision={self.config.precision!r}, lr={bad.lr:.3g}. Lower the "
                "learning rate or look for bad inputs, and resume from a checkpoint taken before that step."
            )
        seconds = max(now - self._interval_started, 1e-9)
        row = {
            "step": steps[-1].step,
            "loss": sum(losses) / len(losses),
            "lr": steps[-1].lr,  # the rate last used
            "grad_norm": sum(norms) / len(norms),
            "tokens_per_second": sum(tokens) / seconds,
        }
        self.history.append(row)
        self._unlogged, self._interval_started = [], now
        return row

    # ----- the training state -----

    def state_dict(self) -> dict:
        """Everything needed to continue this run exactly, as tensors and plain values (``TrainerState``'s fields).
        Like ``nn.Module.state_dict`` it holds live tensors: save or clone it before training on."""
        return {
            # keys without a wrapper's prefix
            "model": unwrap_model(self.model).state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),  # {} when disabled (fp32, bf16)
            "step": self.step,
            "skipped_steps": self.skipped_steps,
            "history": [dict(row) for row in self.history],
            "unlogged": [dict(vars(step)) for step in self._unlogged],
            "seconds_since_log": time.perf_counter() - self._interval_started,
            "config": dataclasses.asdict(self.config),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned, parsed whole first: on a ``ValueError`` nothing has changed.
        An optimizer this trainer built takes its rates, betas and decay from ``config`` (a changed learning rate
        applies from the next step); a passed-in optimizer and scheduler are restored as saved."""
        state = parse_trainer_state(state, self)
        unwrap_model(self.model).load_state_dict(state.model, strict=True)
        load_optimizer_state(self.optimizer, state.optimizer)
        self.scheduler.load_state_dict(state.scheduler)
        if state.scaler:
            self.scaler.load_state_dict(state.scaler)
        self.step, self.skipped_steps = state.step, state.skipped_steps
        self.history, self._unlogged = state.history, state.unlogged
        self._interval_started = time.perf_counter() - state.seconds_since_log
        if self.owns_optimizer:
            apply_config(self.optimizer, self.scheduler, self.config)

    # ----- validation -----

    def add_val_loss(self, val_batches: Iterable[Batch]) -> float:
        """Write the row of the steps so far, add their ``val_loss`` (``evaluate``) to it, and return it.

        The evaluation's time is left out of the next row's ``tokens_per_second``.
        """
        if self.log() is None and not self.history:
            raise ValueError(
                "Trainer.add_val_loss: no step has been taken, so there is no history row to add to"
            )
        val_loss = evaluate(self.model, val_batches, self.device, self.config.precision)
        self.history[-1]["val_loss"] = val_loss
        self._interval_started = time.perf_counter()
        return val_loss


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: Iterable[Batch],
    device: torch.device,
    precision: str = "fp32",
) -> float:
    """Mean loss per target token over ``batches``, in eval mode (no dropout), one sync at the end."""
    was_training = model.training
    model.eval()
    total_loss, total_tokens = (
        torch.zeros((), device=device),
        torch.zeros((), device=device, dtype=torch.int64),
    )
    for x, y in batches:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        total_loss += summed_loss(model, x, y, precision)
        total_tokens += (y != IGNORE_INDEX).sum()
    model.train(was_training)
    if total_tokens.item() == 0:
        raise ValueError("evaluate: the batches hold no target tokens")
    return (total_loss / total_tokens).item()


def parse_trainer_state(state: Mapping[str, Any], trainer: Trainer) -> TrainerState:
    """``state`` as a ``TrainerState`` that ``trainer`` applies without failing half-way, or a ``ValueError``.

    Checked: every field present; the model's keys, shapes and dtypes; the optimizer's layout; loss scaling
    on or off as in ``trainer``; the counters, history and unlogged steps by type. The values inside (a
    learning rate, a moment's numbers) are the file's: see the trust model in ``torchbook.checkpoint``.
    """
    names = [field.name for field in dataclasses.fields(TrainerState)]
    if not isinstance(state, Mapping) or any(name not in state for name in names):
        found = sorted(state) if isinstance(state, Mapping) else type(state).__name__
        raise ValueError(
            f"Trainer.load_state_dict: expected a dict with {', '.join(names)}; got {found}"
        )
    problems = [
        f"model: {line}" for line in state_dict_problems(trainer.model, state["model"])
    ]
    problems += optimizer_layout_problems(state["optimizer"], trainer.optimizer)
    if (
        not isinstance(state["scaler"], dict)
        or bool(state["scaler"]) != trainer.scaler.is_enabled()
    ):
        problems.append(
            f"scaler: loss scaling (fp16) is {'on' if state['scaler'] else 'off'} in the state, "
            f"{'on' if trainer.scaler.is_enabled() else 'off'} now"
        )
    problems += [
        f"{key}: {state[key]!r}, expected an int >= 0"
        for key in ("step", "skipped_steps")
        if type(state[key]) is not int or state[key] < 0
    ]
    problems += [
        f"{key}: expected a {kind.__name__}"
        for key, kind in (
            ("scheduler", dict),
            ("config", dict),
            ("history", list),
            ("unlogged", list),
            ("seconds_since_log", float),
        )
        if type(state[key]) is not kind
    ]
    if problems:
        raise ValueError(
            "Trainer.load_state_dict: the state does not fit this trainer; nothing was loaded:\n  "
            + "\n  ".join(problems)
        )
    try:  # copies, on this trainer's device: applying them cannot fail, and shares nothing with `state`
        history = [dict(row) for row in state["history"]]
        unlogged = [
            StepResult(
                **{
                    **step,
                    **{
                        key: step[key].to(trainer.device)
                        for key in ("loss", "grad_norm", "target_tokens")
                    },
                }
            )
            for step in state["unlogged"]
        ]
    # a row that is not a dict of its fields
    except (
        TypeError,
        ValueError,
        KeyError,
        AttributeError,
    ) as error:
        raise ValueError(
            f"Trainer.load_state_dict: a history row or unlogged step is unreadable ({error})"
        ) from error
    return TrainerState(
        **{
            **state,
            "scheduler": dict(state["scheduler"]),
            "history": history,
            "unlogged": unlogged,
        }
    )
