"""The book's training loop: one optimizer step, written out in named parts.

A step over ``accum_steps`` micro-batches counts the target tokens, runs
the forward under ``torch.autocast`` with the loss in float32 (summed over
the tokens and divided by the step's count: the gradient of the *mean*
loss over the whole step), backpropagates through the fp16 loss scaler,
clips, sets the learning rate, steps and zeroes the gradients; the
numbered comments follow that order.

Losses stay on the device and are read to the host (a sync) only every
``log_every`` steps, when a ``history`` row is written. A NaN or inf
gradient norm is recorded on the device at its step (in fp32 and bf16
nothing skips such a step), and ``log`` and ``state_dict`` raise
``NonFiniteLossError`` naming that step. In fp16 the scaler skips such
steps; the step reads the scale (a sync) to know.

**The step is the API**: ``Trainer.train_step(micro_batches)``, called by
each script in a short loop of its own. The loop draws no random numbers:
the caller seeds them. ``Trainer.state_dict`` and ``load_state_dict`` save
and restore everything that continues a run exactly; what that is, and
how a saved state is parsed whole before anything changes, is
``torchbook.trainer_state``.

It builds on ``torchbook.loss`` (the forward and the float32 loss,
summed), ``torchbook.optim`` (the AdamW and its schedule),
``torchbook.trainer_state``, ``torchbook.state_dicts`` (unwrapping
``torch.compile`` and DDP) and ``torchbook.chat`` (for ``IGNORE_INDEX``,
the label the loss skips).

**Distributed.** With more than one rank the model must be DDP or FSDP2,
which *average* gradients: the step all-reduces the token count, scales
each loss by the world size (the gradient of the global mean, however the
tokens fall per rank) and synchronises gradients on the last micro-batch
only. ``state_dict`` suits one process or DDP; FSDP2's sharded weights
need ``torch.distributed.checkpoint``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from torchbook.chat import IGNORE_INDEX  # targets not scored: padding, prompts
from torchbook.device import AUTOCAST_DTYPES
from torchbook.loss import summed_loss
from torchbook.optim import (
    OptimizerConfig,
    apply_config,
    build_adamw,
    load_optimizer_state,
    set_learning_rate,
)
from torchbook.state_dicts import unwrap_model
from torchbook.trainer_state import StepResult, parse_trainer_state

Batch = tuple[Tensor, Tensor]  # (inputs, targets)
# fp16 steps the scaler may skip in a row: from its initial 2**16 the scale is then
# 2**-8, and gradients that still overflow come from a forward pass that does.
MAX_SKIPS_IN_A_ROW = 24


class NonFiniteLossError(RuntimeError):
    """The loss or gradient became NaN or inf, or fp16 overflowed step after step."""


@dataclass
class TrainConfig(OptimizerConfig):
    """Everything the loop needs besides the model and the data.

    The first six fields, ``OptimizerConfig``'s, make the optimizer and the
    schedule; the rest are the loop's own.
    """

    accum_steps: int = 1  # micro-batches per optimizer step
    # clip the total gradient norm to this; None: no clipping
    max_grad_norm: float | None = 1.0
    # "fp32" | "bf16" | "fp16": the autocast dtype of the forward pass
    precision: str = "fp32"
    log_every: int = 10  # steps between history rows, i.e. between host syncs
    # >1: the head and the loss over this many slices of the sequence (a GPT only)
    loss_chunks: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.precision not in AUTOCAST_DTYPES:
            raise ValueError(
                f"TrainConfig.precision must be one of {sorted(AUTOCAST_DTYPES)}, "
                f"got {self.precision!r}"
            )
        for name in ("accum_steps", "log_every", "loss_chunks"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"TrainConfig.{name}: expected an int >= 1, got {value!r}"
                )
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ValueError(
                "TrainConfig.max_grad_norm must be > 0 or None, "
                f"got {self.max_grad_norm}"
            )


def _world_size() -> int:
    """The number of ranks; 1 without a process group."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _check_model(model: nn.Module, device: torch.device) -> None:
    """Raise unless ``model`` is on ``device`` and, with several ranks, DDP or FSDP.

    ``device`` is where AdamW creates its moments, so a model elsewhere
    would fail at the first step; DDP and FSDP average gradients over the
    ranks, which the step's scaling by the world size relies on.
    """
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        where = tensor.device
        if where.type != device.type or device.index not in (None, where.index):
            raise ValueError(
                f"Trainer: model tensor {name!r} is on {where}, expected {device}; "
                f"call model.to({str(device)!r}) before building the Trainer"
            )
    averages = hasattr(model, "no_sync") or hasattr(model, "set_requires_gradient_sync")
    if _world_size() > 1 and not averages:
        raise ValueError(
            f"Trainer: torch.distributed runs {_world_size()} ranks but "
            f"{type(model).__name__} is neither DDP nor FSDP; wrap the model so that "
            "its gradients are averaged over the ranks"
        )


def _keep_root_gathered(model: nn.Module, loss_chunks: int) -> None:
    """FSDP2: keep the root's weights gathered after its forward for a chunked loss.

    The chunked head and loss run after the root module's forward has
    returned, on the root's weights (the tied head); resharded, they would
    no longer be whole.
    """
    if loss_chunks > 1 and hasattr(model, "set_reshard_after_forward"):
        # gathered until the root's backward: fully_shard's default for a root
        model.set_reshard_after_forward(False, recurse=False)


def _gradient_sync(model: nn.Module, last: bool) -> contextlib.AbstractContextManager:
    """Context for one micro-batch's backward: gradients synchronised on the last."""
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(last)
    elif not last and hasattr(model, "no_sync"):  # DDP
        return model.no_sync()
    return contextlib.nullcontext()


class Trainer:
    """Trains ``model`` with clipping, mixed precision and a learning-rate schedule.

    ``model`` maps inputs to logits. ``optimizer`` defaults to
    ``build_adamw``'s, and before each step the Trainer writes
    ``learning_rate(step, config)`` into it, unless a ``scheduler`` comes
    with the optimizer. ``step`` counts optimizer steps (fp16 steps the
    scaler skipped: ``skipped_steps``); ``history`` has a row per
    ``log_every`` steps: step, loss, lr, grad_norm, tokens_per_second.
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
        _keep_root_gathered(model, config.loss_chunks)
        if scheduler is not None and optimizer is None:
            raise ValueError("Trainer: a scheduler was passed without its optimizer")
        self.model, self.config, self.device = model, config, device
        self.owns_optimizer = optimizer is None  # so a load sets it to config
        self.optimizer = optimizer or build_adamw(model, config, device)
        self.scheduler = scheduler  # None: the Trainer sets the rate itself
        # Loss scaling only for fp16: its narrow range flushes small gradients to zero.
        self.scaler = torch.amp.GradScaler(
            device.type, enabled=config.precision == "fp16"
        )
        self.step, self.skipped_steps, self._skips_in_a_row = 0, 0, 0
        self.history: list[dict] = []
        self._unlogged: list[StepResult] = []  # steps not yet in history
        # the first step with a NaN or inf gradient norm (0: none), kept on the device
        self._nonfinite_step = torch.zeros((), dtype=torch.int64, device=device)
        self._interval_started = time.perf_counter()

    # ----- one optimizer step, in its named parts -----

    def accumulate_gradients(
        self, micro_batches: Sequence[Batch]
    ) -> tuple[Tensor, Tensor]:
        """Parts 1-3 over ``micro_batches``: the mean loss and the target tokens.

        Both are tensors on the device. Each summed loss is divided by the
        token count of *all* micro-batches, so the accumulated gradient is
        exactly one big batch's, however the tokens are spread.
        """
        batches = [
            (x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True))
            for x, y in micro_batches
        ]
        world_size = _world_size()
        # 1. count on the device (no sync); summed over ranks when distributed.
        target_tokens = sum((y != IGNORE_INDEX).sum() for _, y in batches)
        if world_size > 1:
            dist.all_reduce(target_tokens, op=dist.ReduceOp.SUM)
        target_tokens = target_tokens.clamp(min=1)  # an all-ignored step: loss 0
        step_loss = torch.zeros((), device=self.device)
        self.model.train()
        for index, (x, y) in enumerate(batches):
            with _gradient_sync(self.model, last=index == len(batches) - 1):
                # 2. forward in low precision, loss in float32, divided by the whole
                # step's token count.
                loss = (
                    summed_loss(
                        self.model, x, y, self.config.precision, self.config.loss_chunks
                    )
                    / target_tokens
                )
                # 3. backward; gradients add up in .grad across micro-batches.
                #    DDP/FSDP average over ranks, so times world_size gives the sum:
                #    the global mean's gradient.
                self.scaler.scale(loss * world_size).backward()
            step_loss += loss.detach()
        if world_size > 1:  # each rank holds its share of the global mean
            dist.all_reduce(step_loss, op=dist.ReduceOp.SUM)
        return step_loss, target_tokens

    def clip_gradients(self) -> Tensor:
        """Part 4: unscale, then clip; returns the norm before clipping.

        Unscaling comes first: in fp16 a scaled norm is ``scale`` times too
        large. Without ``max_grad_norm`` the clip is at infinity, a
        multiplication by exactly 1.0.
        """
        self.scaler.unscale_(self.optimizer)
        parameters = [p for g in self.optimizer.param_groups for p in g["params"]]
        # None clips at infinity: a multiplication by exactly 1.0
        norm = torch.nn.utils.clip_grad_norm_(
            parameters, self.config.max_grad_norm or math.inf
        )
        if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor, whole on every rank
            norm = norm.full_tensor()
        return norm.detach()

    def train_step(self, micro_batches: Sequence[Batch]) -> StepResult:
        """One optimizer step over ``micro_batches`` (usually ``accum_steps``).

        A step the fp16 scaler skips counts in ``skipped_steps``, not ``step``,
        and leaves the schedule where it was.
        """
        if len(micro_batches) == 0:
            raise ValueError("Trainer.train_step: got no micro-batches")
        # fp16: GradScaler halves its scale exactly when it skips a step. Reading it is
        # a host sync, paid only with the scaler on; here, before this step's work is
        # queued, the read waits for nothing.
        scale_before = self.scaler.get_scale() if self.scaler.is_enabled() else None
        step_loss, target_tokens = self.accumulate_gradients(micro_batches)
        grad_norm = self.clip_gradients()
        # fp32, bf16 (nothing skips): the first step with a NaN or inf norm, on device
        if scale_before is None:
            first = (self._nonfinite_step == 0) & ~grad_norm.isfinite()
            self._nonfinite_step.masked_fill_(first, self.step + 1)
        # 5. the learning rate: the schedule's (a function of the step) or the passed
        # scheduler's.
        if self.scheduler is None:
            lr = set_learning_rate(self.optimizer, self.step, self.config)
        else:
            lr = float(self.optimizer.param_groups[0]["lr"])
        # 6. step (skipped by the scaler if an fp16 gradient is inf/nan), then update
        #    the scale. The book's fused AdamW takes the scaler's inf check on the
        #    device: no .item() in scaler.step.
        self.scaler.step(self.optimizer)
        self.scaler.update()
        # 7. zero: None instead of a tensor of zeros; the next backward writes instead
        # of adding.
        self.optimizer.zero_grad(set_to_none=True)
        result = StepResult(self.step, lr, step_loss, grad_norm, target_tokens, False)
        if scale_before is not None and self._skipped(scale_before):
            result.skipped = True
            return result
        if self.scheduler is not None:
            self.scheduler.step()
        self.step += 1
        result.step = self.step
        self._unlogged.append(result)
        if self.step % self.config.log_every == 0:
            self.log()
        return result

    def _skipped(self, scale_before: float) -> bool:
        """Whether the scaler skipped this step (a sync); raise if it keeps skipping.

        ``GradScaler`` halves its scale exactly when it skips a step. After
        ``MAX_SKIPS_IN_A_ROW`` skips, or at a scale of 0, no loss scale helps:
        the overflow comes from the forward pass.
        """
        scale = self.scaler.get_scale()
        skipped = scale < scale_before or scale == 0
        self._skips_in_a_row = self._skips_in_a_row + 1 if skipped else 0
        self.skipped_steps += skipped
        if self._skips_in_a_row >= MAX_SKIPS_IN_A_ROW or scale == 0:
            raise NonFiniteLossError(
                f"fp16 overflows in the forward pass; use bf16 ({self._skips_in_a_row} "
                f"steps skipped in a row after step {self.step}, loss scale {scale:g})"
            )
        return skipped

    def log(self) -> dict | None:
        """Read the steps since the last row to the host (a sync); append a row.

        Returns the row, or None when no step was taken since the last one.
        A NaN or inf norm raises ``NonFiniteLossError`` naming its step.
        """
        steps = self._unlogged
        if not steps:
            return None
        losses, norms, tokens = (
            torch.stack([getattr(step, name) for step in steps]).tolist()
            for name in ("loss", "grad_norm", "target_tokens")
        )
        now = time.perf_counter()  # after the sync: the steps' work is done
        self._check_finite()
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

    def _check_finite(self) -> None:
        """Raise ``NonFiniteLossError`` if a step had a NaN or inf norm (one sync)."""
        bad = int(self._nonfinite_step.item())
        if bad:
            step = next(step for step in self._unlogged if step.step == bad)
            raise NonFiniteLossError(
                f"loss {step.loss.item()}, gradient norm {step.grad_norm.item()} at "
                f"optimizer step {bad} ({self.config.precision}, lr {step.lr:.3g}); "
                "lower the learning rate or look for bad inputs, and resume from a "
                "checkpoint before that step"
            )

    def state_dict(self) -> dict:
        """Everything needed to continue this run exactly (``TrainerState``'s fields).

        Tensors and plain values, which ``torch.load(weights_only=True)``
        reads back. Like ``nn.Module.state_dict`` it holds live tensors: save
        or clone it before training on.
        """
        self._check_finite()  # never save the update of a non-finite step
        return {
            "model": unwrap_model(self.model).state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler else {},
            "scaler": self.scaler.state_dict(),  # {} when disabled (fp32, bf16)
            "step": self.step,
            "skipped_steps": self.skipped_steps,
            "skips_in_a_row": self._skips_in_a_row,
            "history": [dict(row) for row in self.history],
            "unlogged": [dict(vars(step)) for step in self._unlogged],
            "seconds_since_log": time.perf_counter() - self._interval_started,
            "config": dataclasses.asdict(self.config),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned, parsed whole first.

        On a ``ValueError`` nothing has changed (``parse_trainer_state``). The
        Trainer's own optimizer then takes ``config``'s betas and weight decay;
        a passed optimizer keeps the settings it was saved with. Without a
        scheduler every step's rate comes from ``config``'s schedule, so a
        changed learning rate applies at once.
        """
        state = parse_trainer_state(
            state,
            model=self.model,
            optimizer=self.optimizer,
            scaler=self.scaler,
            scheduler=self.scheduler,
            device=self.device,
        )
        unwrap_model(self.model).load_state_dict(state.model, strict=True)
        load_optimizer_state(self.optimizer, state.optimizer)
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state.scheduler)
        if state.scaler:
            self.scaler.load_state_dict(state.scaler)
        self.step, self.skipped_steps = state.step, state.skipped_steps
        self._skips_in_a_row = state.skips_in_a_row
        self.history, self._unlogged = state.history, state.unlogged
        self._nonfinite_step.zero_()  # a state with a non-finite step is never saved
        self._interval_started = time.perf_counter() - state.seconds_since_log
        if self.owns_optimizer:  # its own takes config's rates; a passed one stays
            apply_config(self.optimizer, self.config)

    def add_val_loss(self, val_batches: Iterable[Batch]) -> float:
        """Write the row of the steps so far and add their ``val_loss`` to it.

        Returns ``val_loss`` (``evaluate``'s). The evaluation's time is left
        out of the next row's ``tokens_per_second``.
        """
        if self.log() is None and not self.history:
            raise ValueError("Trainer.add_val_loss: no step has been taken yet")
        val_loss = evaluate(self.model, val_batches, self.device, self.config.precision)
        self.history[-1]["val_loss"] = val_loss
        self._interval_started = time.perf_counter()  # the evaluation is not counted
        return val_loss


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: Iterable[Batch],
    device: torch.device,
    precision: str = "fp32",
) -> float:
    """Mean loss per target token over ``batches``, in eval mode (no dropout).

    The losses and token counts add up on the device: one sync, at the end.
    The model's mode is restored.
    """
    was_training = model.training
    model.eval()
    total_loss = torch.zeros((), device=device)
    total_tokens = torch.zeros((), device=device, dtype=torch.int64)
    for x, y in batches:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        total_loss += summed_loss(model, x, y, precision)
        total_tokens += (y != IGNORE_INDEX).sum()
    model.train(was_training)
    if total_tokens.item() == 0:
        raise ValueError("evaluate: the batches hold no target tokens")
    return (total_loss / total_tokens).item()
