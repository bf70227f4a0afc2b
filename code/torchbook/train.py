"""The book's training loop: one optimizer step, written out in named parts.

A step over ``accum_steps`` micro-batches counts the target tokens, runs the
forward under ``torch.autocast`` with the loss in float32 (summed over tokens
and divided by the step's count: the gradient of the *mean* loss over the whole
step), backpropagates through the fp16 loss scaler, clips, steps, advances the
schedule and zeroes the gradients; the numbered comments follow that order.
Losses stay on the device and are read to the host (a sync) only every
``log_every`` steps, when a ``history`` row is written; a non-finite loss is
noticed then, and the error names the step where it started.

The ``Trainer`` owns the training state: ``state_dict()`` holds tensors and
plain values (``torch.load(..., weights_only=True)`` reads it), and
``load_state_dict`` checks all of it before changing anything. It builds on
``torchbook.optim``: the default optimizer and schedule, and the checks of a
saved optimizer state that torch itself would load without complaint.

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
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from torchbook.optim import (
    LISTED_KEYS, OptimizerConfig, apply_config, build_optimizer, build_schedule, load_optimizer_state,
    optimizer_state_problems, structure_problems,
)

# Targets equal to this are not scored (padding, prompt tokens): cross_entropy's own default.
IGNORE_INDEX = -100

# The autocast dtype of each precision; "fp32" disables autocast and is listed so every precision has one.
AUTOCAST_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
STATE_KEYS = ("model", "optimizer", "scheduler", "scaler", "step", "skipped_steps", "history", "pending", "config")
PENDING_KEYS = ("steps", "lr", "loss", "grad_norm", "target_tokens", "seconds")


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
    max_grad_norm: float | None = 1.0  # clip the total gradient norm to this; None: no clipping
    precision: str = "fp32"  # "fp32" | "bf16" | "fp16" (autocast dtype of the forward pass)
    eval_every: int = 100  # fit() evaluates every this many steps (and at the end)
    log_every: int = 10  # steps between history rows, i.e. between host syncs

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.precision not in AUTOCAST_DTYPES:
            raise ValueError(f"TrainConfig.precision must be one of {sorted(AUTOCAST_DTYPES)}, got {self.precision!r}")
        for name in ("accum_steps", "eval_every", "log_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"TrainConfig.{name} must be a positive int, got {value!r}")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ValueError(f"TrainConfig.max_grad_norm must be > 0 or None, got {self.max_grad_norm}")


@dataclass
class StepResult:
    """What ``train_step`` returns. The tensors stay on the device: reading them is a sync."""

    loss: Tensor  # mean loss over the step's target tokens (global across ranks when distributed)
    grad_norm: Tensor  # total gradient norm before clipping
    target_tokens: Tensor  # the step's target-token count (global across ranks when distributed)
    skipped: bool  # True when the fp16 scaler skipped the step (step and schedule did not advance)


def _check_on_device(model: nn.Module, device: torch.device) -> None:
    """Raise unless every tensor of ``model`` is on ``device``, where AdamW will create its moments."""
    for name, tensor in itertools.chain(model.named_parameters(), model.named_buffers()):
        if tensor.device.type != device.type or device.index not in (None, tensor.device.index):
            raise ValueError(f"Trainer: model tensor {name!r} is on {tensor.device}, expected {device}; "
                             f"call model.to({str(device)!r}) before building the Trainer")


def _inner_module(model: nn.Module) -> nn.Module:
    """The module inside torch.compile (``_orig_mod``) and DDP (``.module``) wrappers: its keys load into a plain model."""
    while isinstance(getattr(model, "_orig_mod", None), nn.Module) or isinstance(model, nn.parallel.DistributedDataParallel):
        model = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model._orig_mod
    return model


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class Trainer:
    """Trains ``model`` (inputs -> logits) with clipping, mixed precision and a learning-rate schedule.

    ``optimizer`` and ``scheduler`` default to ``build_optimizer``'s AdamW with
    warmup + cosine; a passed optimizer without a scheduler gets that shape on
    its own rate. ``step`` counts the optimizer steps done (an fp16 step the
    scaler skipped counts in ``skipped_steps`` instead); ``history`` has a row
    per logged step: ``step``, ``loss``, ``lr`` (the rate used), ``grad_norm``,
    ``tokens_per_second`` and, where evaluated, ``val_loss``.
    """

    def __init__(self, model: nn.Module, config: TrainConfig, device: torch.device | str,
                 optimizer: torch.optim.Optimizer | None = None,
                 scheduler: torch.optim.lr_scheduler.LRScheduler | None = None) -> None:
        device = torch.device(device)
        _check_on_device(model, device)
        if scheduler is not None and optimizer is None:
            raise ValueError("Trainer: a scheduler was passed without its optimizer; pass both")
        world_size = _world_size()
        if world_size > 1 and not (hasattr(model, "no_sync") or hasattr(model, "set_requires_gradient_sync")):
            raise ValueError(f"Trainer: torch.distributed runs {world_size} ranks but {type(model).__name__} is "
                             "neither DDP nor FSDP; wrap the model so that its gradients are averaged over the ranks")
        self.model, self.config, self.device = model, config, device
        self.autocast_dtype = AUTOCAST_DTYPES[config.precision]
        self.owns_optimizer = optimizer is None  # built from config, so load_state_dict sets it to config
        if optimizer is None:
            optimizer, scheduler = build_optimizer(model, config, device)
        elif scheduler is None:
            scheduler = build_schedule(optimizer, config)
        self.optimizer, self.scheduler = optimizer, scheduler
        # Loss scaling only for fp16, whose narrow exponent range flushes small gradients to zero.
        self.scaler = torch.amp.GradScaler(device.type, enabled=config.precision == "fp16")
        self.step = 0
        self.skipped_steps = 0
        self.history: list[dict] = []
        # Steps since the last history row: (step, lr, loss, grad_norm, target_tokens), tensors on the device.
        self._unlogged: list[tuple[int, float, Tensor, Tensor, Tensor]] = []
        self._interval_started = time.perf_counter()

    # ----- one optimizer step, in its named parts -----

    def _gradient_sync(self, last: bool) -> contextlib.AbstractContextManager:
        """Context for one micro-batch's backward: synchronise gradients over ranks on the last one only."""
        set_sync = getattr(self.model, "set_requires_gradient_sync", None)
        if set_sync is not None:  # FSDP2
            set_sync(last)
            return contextlib.nullcontext()
        if not last and hasattr(self.model, "no_sync"):  # DDP
            return self.model.no_sync()
        return contextlib.nullcontext()

    def accumulate_gradients(self, micro_batches: Sequence[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
        """Parts 1-3 over ``micro_batches``; returns (mean loss, target tokens) as device tensors.

        Dividing each summed loss by the token count of *all* micro-batches makes
        the accumulated gradient exactly one big batch's, however the sizes and
        ignored tokens are spread.
        """
        batches = [(x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True))
                   for x, y in micro_batches]
        world_size = _world_size()
        # 1. count: a tensor on the device, so no sync; summed over ranks when distributed.
        target_tokens = sum((y != IGNORE_INDEX).sum() for _, y in batches)
        if world_size > 1:
            dist.all_reduce(target_tokens, op=dist.ReduceOp.SUM)
        target_tokens = target_tokens.clamp(min=1)  # at least 1, so an all-ignored step gives loss 0
        step_loss = torch.zeros((), device=self.device)
        self.model.train()
        for index, (x, y) in enumerate(batches):
            with self._gradient_sync(last=index == len(batches) - 1):
                # 2. forward in low precision, loss in float32 (log-softmax over a large
                #    vocabulary loses digits in bf16/fp16).
                with torch.autocast(self.device.type, dtype=self.autocast_dtype,
                                    enabled=self.config.precision != "fp32"):
                    logits = self.model(x)
                loss = F.cross_entropy(logits.float().flatten(0, -2), y.flatten(),
                                       ignore_index=IGNORE_INDEX, reduction="sum") / target_tokens
                # 3. backward; gradients add up in .grad across micro-batches. DDP/FSDP average
                #    over ranks, so times world_size gives the sum: the global mean's gradient.
                self.scaler.scale(loss * world_size if world_size > 1 else loss).backward()
            step_loss += loss.detach()
        if world_size > 1:
            dist.all_reduce(step_loss, op=dist.ReduceOp.SUM)  # each rank's share of the global mean
        return step_loss, target_tokens

    def clip_gradients(self) -> Tensor:
        """Part 4: unscale (fp16), then clip; returns the total norm before clipping.

        Unscaling first matters: a scaled norm is ``scale`` times too large for ``max_grad_norm``.
        """
        self.scaler.unscale_(self.optimizer)
        parameters = [p for group in self.optimizer.param_groups for p in group["params"]]
        if self.config.max_grad_norm is None:
            return torch.nn.utils.get_total_norm([p.grad for p in parameters if p.grad is not None])
        return torch.nn.utils.clip_grad_norm_(parameters, self.config.max_grad_norm)

    def train_step(self, micro_batches: Sequence[tuple[Tensor, Tensor]]) -> StepResult:
        """One optimizer step over ``micro_batches`` (usually ``accum_steps``, fewer at the end of the data).

        When the fp16 scaler skips the step, ``skipped_steps`` advances instead
        of ``step`` and the result says ``skipped``.
        """
        if len(micro_batches) == 0:
            raise ValueError("Trainer.train_step: got no micro-batches; a step needs at least one")
        step_loss, target_tokens = self.accumulate_gradients(micro_batches)
        grad_norm = self.clip_gradients().detach()
        if hasattr(grad_norm, "full_tensor"):  # FSDP2 returns the norm as a replicated DTensor
            grad_norm = grad_norm.full_tensor()
        lr = self.optimizer.param_groups[0]["lr"]  # the rate this step uses, before the schedule moves it
        # 5. step (skipped by the scaler if an fp16 gradient is inf/nan), then update the scale.
        scale_before = self.scaler.get_scale() if self.scaler.is_enabled() else None
        self.scaler.step(self.optimizer)
        self.scaler.update()
        # The scaler halves its scale exactly when it skipped the step (a sync, but fp16's
        # scaler.step has already synced to look for infs).
        skipped = scale_before is not None and self.scaler.get_scale() < scale_before
        # 6. schedule: the next step's learning rate; a skipped step does not advance it.
        if not skipped and self.scheduler is not None:
            self.scheduler.step()
        # 7. zero: None instead of a tensor of zeros; the next backward writes instead of adding.
        self.optimizer.zero_grad(set_to_none=True)
        result = StepResult(loss=step_loss, grad_norm=grad_norm, target_tokens=target_tokens, skipped=skipped)
        if skipped:
            self.skipped_steps += 1
            return result
        self.step += 1
        self._unlogged.append((self.step, float(lr), step_loss, grad_norm, target_tokens))
        if self.step % self.config.log_every == 0:
            self.log()
        return result

    def log(self) -> dict | None:
        """Read the steps since the last row to the host (a sync) and append a history row.

        Returns the row, or None if no step ran since the last one. Raises
        ``NonFiniteLossError`` naming the first step whose loss was not finite.
        """
        if not self._unlogged:
            return None
        steps, rates, *tensors = zip(*self._unlogged)
        losses, norms, tokens = (torch.stack(values).tolist() for values in tensors)
        now = time.perf_counter()
        bad = [(step, loss, lr) for step, loss, lr in zip(steps, losses, rates) if not math.isfinite(loss)]
        if bad:
            raise NonFiniteLossError(
                f"training loss is {bad[0][1]} at optimizer step {bad[0][0]} "
                f"(noticed at step {steps[-1]}, when the losses were read); precision="
                f"{self.config.precision!r}, lr={bad[0][2]:.3g}. "
                "Lower the learning rate or look for bad inputs, and resume from a checkpoint "
                "taken before that step."
            )
        row = {
            "step": steps[-1],
            "loss": sum(losses) / len(losses),
            "lr": rates[-1],  # the rate the optimizer used for the logged step
            "grad_norm": sum(norms) / len(norms),
            "tokens_per_second": sum(tokens) / max(now - self._interval_started, 1e-9),
        }
        self.history.append(row)
        self._unlogged.clear()
        self._interval_started = now
        return row

    # ----- the training state -----

    def state_dict(self) -> dict:
        """Everything needed to continue this run exactly, as tensors and plain values.

        The model without wrapper prefixes; the unlogged steps as tensors (no
        sync) with the seconds they took; the config as a dict. Like
        ``nn.Module.state_dict`` it holds live tensors: save or clone it before training on.
        """
        columns = list(zip(*self._unlogged)) or [() for _ in range(5)]
        pending = {"steps": list(columns[0]), "lr": list(columns[1])}
        for key, values in zip(("loss", "grad_norm", "target_tokens"), columns[2:]):  # tensors: no sync
            empty = torch.zeros(0, device=self.device, dtype=torch.int64 if key == "target_tokens" else None)
            pending[key] = torch.stack(values) if values else empty
        pending["seconds"] = time.perf_counter() - self._interval_started
        return {
            "model": _inner_module(self.model).state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict(),  # {} when disabled (fp32, bf16)
            "step": self.step,
            "skipped_steps": self.skipped_steps,
            "history": [dict(row) for row in self.history],
            "pending": pending,
            "config": dataclasses.asdict(self.config),
        }

    def state_dict_problems(self, state: Any) -> list[str]:
        """Every way ``state`` does not fit this trainer, as readable lines; empty when it loads.

        Checked in full against this trainer's own ``state_dict()`` (keys, the
        model's shapes and dtypes, the optimizer's groups, kinds of values), so
        that ``load_state_dict`` can refuse before changing anything.
        """
        if not isinstance(state, Mapping):
            return [f"trainer state is a {type(state).__name__}, expected a dict"]
        missing = [key for key in STATE_KEYS if key not in state]
        if missing:
            return [f"trainer state has no {', '.join(repr(key) for key in missing)}"]
        live = self.state_dict()
        model, optimizer, scaler = state["model"], state["optimizer"], state["scaler"]
        problems = structure_problems(model, live["model"], "model")
        unexpected = [key for key in model if key not in live["model"]] if isinstance(model, Mapping) else []
        if unexpected:
            problems.append(f"model: {len(unexpected)} unexpected keys: {unexpected[:LISTED_KEYS]}")
        problems += optimizer_state_problems(optimizer, self.optimizer)
        problems += structure_problems(state["scheduler"], live["scheduler"], "scheduler")
        if isinstance(scaler, Mapping) and bool(scaler) != self.scaler.is_enabled():
            now = "on" if self.scaler.is_enabled() else "off"
            problems.append(f"scaler: loss scaling (fp16) is {'on' if scaler else 'off'} in the state, {now} now")
        else:
            problems += structure_problems(scaler, live["scaler"], "scaler")
        problems += [f"{key}: {state[key]!r}, expected an int >= 0" for key in ("step", "skipped_steps")
                     if not _is_count(state[key])]
        if not isinstance(state["history"], list) or not all(isinstance(row, Mapping) for row in state["history"]):
            problems.append("history: expected a list of dicts")
        problems += _pending_problems(state["pending"])
        return problems + structure_problems(state["config"], live["config"], "config", optional=True)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned; on any problem raise ``ValueError`` and change nothing.

        An optimizer this trainer built takes its rates, betas and decay from
        ``config``, so a changed learning rate applies from the next step (the
        rate used and logged is ``learning_rate(step, config)``). A passed-in
        optimizer and scheduler are restored as saved.
        """
        problems = self.state_dict_problems(state)
        if problems:
            raise ValueError("Trainer.load_state_dict: the state does not fit this trainer; "
                             "nothing was loaded:\n  " + "\n  ".join(problems))
        _inner_module(self.model).load_state_dict(state["model"], strict=True)
        load_optimizer_state(self.optimizer, state["optimizer"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])
        self.step = state["step"]
        self.skipped_steps = state["skipped_steps"]
        self.history = [dict(row) for row in state["history"]]
        pending = state["pending"]
        self._unlogged = [
            (step, float(lr), loss.to(self.device), norm.to(self.device), tokens.to(self.device))
            for step, lr, loss, norm, tokens in zip(*(pending[key] for key in PENDING_KEYS[:5]))
        ]
        self._interval_started = time.perf_counter() - float(pending["seconds"])
        if self.owns_optimizer:
            apply_config(self.optimizer, self.scheduler, self.config)

    # ----- evaluation and the whole run -----

    @torch.no_grad()
    def evaluate(self, batches: Iterable[tuple[Tensor, Tensor]]) -> float:
        """Mean loss per target token over ``batches``, in eval mode (no dropout), one sync at the end."""
        was_training = self.model.training
        self.model.eval()
        total_loss = torch.zeros((), device=self.device)
        total_tokens = torch.zeros((), device=self.device, dtype=torch.int64)
        for x, y in batches:
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            with torch.autocast(self.device.type, dtype=self.autocast_dtype,
                                enabled=self.config.precision != "fp32"):
                logits = self.model(x)
            total_loss += F.cross_entropy(logits.float().flatten(0, -2), y.flatten(),
                                          ignore_index=IGNORE_INDEX, reduction="sum")
            total_tokens += (y != IGNORE_INDEX).sum()
        self.model.train(was_training)
        if total_tokens.item() == 0:
            raise ValueError("Trainer.evaluate: the batches hold no target tokens")
        return (total_loss / total_tokens).item()

    def fit(self, train_batches: Iterator[tuple[Tensor, Tensor]],
            val_batches: Callable[[], Iterable[tuple[Tensor, Tensor]]] | None = None) -> list[dict]:
        """Train until ``config.max_steps`` steps are done or ``train_batches`` runs out.

        Micro-batches are taken ``accum_steps`` at a time (a shorter group at the
        end is still one correctly normalised step). ``val_batches()`` gives fresh
        batches every ``eval_every`` steps and after the last; the loss goes into
        that step's row as ``val_loss``.
        """
        train_batches = iter(train_batches)
        while self.step < self.config.max_steps:
            group = list(itertools.islice(train_batches, self.config.accum_steps))
            if not group:
                break
            result = self.train_step(group)
            if val_batches is not None and not result.skipped and self.step % self.config.eval_every == 0:
                self._evaluate_into_history(val_batches)
        self.log()
        if val_batches is not None and self.history and "val_loss" not in self.history[-1]:
            self._evaluate_into_history(val_batches)
        return self.history

    def _evaluate_into_history(self, val_batches: Callable[[], Iterable[tuple[Tensor, Tensor]]]) -> None:
        """Add ``val_loss`` to the row for the current step (writing that row first if needed)."""
        if not self.history or self.history[-1]["step"] != self.step:
            if self.log() is None:
                return  # no step has run yet: nothing to attach a validation loss to
        self.history[-1]["val_loss"] = self.evaluate(val_batches())
        self._interval_started = time.perf_counter()  # evaluation time is not training throughput


# ----- checks behind Trainer.state_dict_problems -----


def _pending_problems(pending: Any) -> list[str]:
    """Whether the not-yet-logged steps are lists and tensors of one length."""
    if not isinstance(pending, Mapping) or any(key not in pending for key in PENDING_KEYS):
        return [f"pending: expected a dict with {', '.join(PENDING_KEYS)}"]
    steps, rates = pending["steps"], pending["lr"]
    if not isinstance(steps, list) or not all(_is_count(step) for step in steps):
        return ["pending['steps']: expected a list of ints"]
    length = len(steps)
    plain = lambda value: isinstance(value, (int, float)) and not isinstance(value, bool)  # noqa: E731
    checks = [("lr", isinstance(rates, list) and len(rates) == length and all(map(plain, rates)),
               f"a list of {length} numbers")]
    checks += [(key, isinstance(pending[key], Tensor) and pending[key].shape == (length,),
                f"a tensor of shape ({length},)") for key in ("loss", "grad_norm", "target_tokens")]
    checks.append(("seconds", plain(pending["seconds"]), "a number"))
    return [f"pending[{key!r}]: expected {expected}" for key, fits, expected in checks if not fits]
