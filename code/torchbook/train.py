"""The book's training loop: one optimizer step, written out in named parts.

A step over ``accum_steps`` micro-batches does, in this order:

1. **count** the target tokens of all its micro-batches (those not equal to
   ``IGNORE_INDEX``), on the device, without a sync;
2. **forward** each micro-batch under ``torch.autocast`` (bf16 or fp16, or
   nothing for fp32), then compute the loss in **float32**, summed over tokens
   and divided by the step's token count, so that the gradients add up to the
   gradient of the *mean* loss over the whole step's tokens;
3. **backward** (through ``scaler.scale`` when fp16; the scaler is a no-op otherwise);
4. **unscale** the gradients and **clip** their total norm (keeping the norm before clipping);
5. **step** the optimizer through the scaler, which skips the step when an fp16
   gradient overflowed, and **update** the scaler's scale;
6. advance the learning-rate **schedule** (linear warmup, then cosine to ``min_lr``);
7. **zero** the gradients by setting them to ``None``.

The loss and the gradient norm stay on the device as tensors. They are read to
the host (a GPU sync) only every ``log_every`` steps, when a row is appended to
``history``. That is also when a non-finite loss is noticed: up to
``log_every - 1`` steps after it happened, steps that have already applied
non-finite updates to the weights. The error names the step where it started,
so you can resume from a checkpoint taken before it.

The trainer keeps no global state: the caller seeds the model's initialisation
(and the global generator that dropout draws from) and the data; the loop
itself draws no random numbers.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# Targets equal to this are not scored (padding, prompt tokens): cross_entropy's own default.
IGNORE_INDEX = -100

AUTOCAST_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,  # autocast disabled; listed so every precision has a dtype
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or infinite (fp32 or bf16, where nothing skips the step)."""


@dataclass
class TrainConfig:
    """Everything the loop needs to know besides the model and the data."""

    max_steps: int = 1000  # optimizer steps that fit() runs
    lr: float = 3e-4  # peak learning rate, reached at the end of warmup
    min_lr: float = 3e-5  # learning rate at max_steps, the end of the cosine
    warmup_steps: int = 100  # steps of linear warmup from lr / warmup_steps to lr
    weight_decay: float = 0.1  # applied to weights with dim >= 2 only
    betas: tuple[float, float] = (0.9, 0.95)  # AdamW's moment decay rates
    accum_steps: int = 1  # micro-batches per optimizer step
    max_grad_norm: float | None = 1.0  # clip the total gradient norm to this; None: no clipping
    precision: str = "fp32"  # "fp32" | "bf16" | "fp16" (autocast dtype of the forward pass)
    eval_every: int = 100  # fit() evaluates every this many steps (and at the end)
    log_every: int = 10  # steps between history rows, i.e. between host syncs

    def __post_init__(self) -> None:
        if self.precision not in AUTOCAST_DTYPES:
            raise ValueError(
                f"TrainConfig.precision must be one of {sorted(AUTOCAST_DTYPES)}, got {self.precision!r}"
            )
        for name in ("max_steps", "accum_steps", "eval_every", "log_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"TrainConfig.{name} must be a positive int, got {value!r}")
        if not isinstance(self.warmup_steps, int) or not 0 <= self.warmup_steps <= self.max_steps:
            raise ValueError(
                f"TrainConfig.warmup_steps must be an int in [0, max_steps={self.max_steps}], "
                f"got {self.warmup_steps!r}"
            )
        if not 0 <= self.min_lr <= self.lr or self.lr <= 0:
            raise ValueError(
                f"TrainConfig needs 0 <= min_lr <= lr and lr > 0, got min_lr={self.min_lr}, lr={self.lr}"
            )
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ValueError(f"TrainConfig.max_grad_norm must be > 0 or None, got {self.max_grad_norm}")


def learning_rate(step: int, config: TrainConfig) -> float:
    """Learning rate for the optimizer step that follows ``step`` completed steps.

    Linear warmup over ``warmup_steps`` (from lr / warmup_steps up to lr), then a
    half cosine from lr down to ``min_lr`` at ``max_steps``, and ``min_lr`` after.
    Warmup keeps the first updates small while AdamW's second-moment estimates
    are still poor; the cosine lets the loss settle at the end.
    """
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    if step >= config.max_steps:
        return config.min_lr
    progress = (step - config.warmup_steps) / max(1, config.max_steps - config.warmup_steps)
    return config.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (config.lr - config.min_lr)


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: matrices (dim >= 2) decay; biases and norm weights (dim < 2) do not.

    Decay pulls weights towards zero. That regularises the matrices that mix
    features, but a LayerNorm gain pulled to zero would switch its layer off,
    and a bias has nothing to regularise. ``named_parameters`` yields a tied
    weight once, so it lands in exactly one group.
    """
    trainable = [p for _, p in model.named_parameters() if p.requires_grad]
    return [
        {"params": [p for p in trainable if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in trainable if p.dim() < 2], "weight_decay": 0.0},
    ]


def _check_on_device(model: nn.Module, device: torch.device) -> None:
    """Raise unless every parameter and buffer already lives on ``device``.

    The optimizer must be built on the parameters where they will train: its
    state (AdamW's moments) is created next to them.
    """
    for name, tensor in itertools.chain(model.named_parameters(), model.named_buffers()):
        where = tensor.device
        if where.type != device.type or (device.index is not None and where.index != device.index):
            raise ValueError(
                f"Trainer: model tensor {name!r} is on {where}, expected {device}; "
                f"call model.to({str(device)!r}) before building the Trainer"
            )


class Trainer:
    """Trains ``model`` (inputs -> logits) with AdamW, a warmup-cosine schedule, clipping and mixed precision.

    ``model``, ``optimizer``, ``scheduler`` and ``scaler`` are public so that a
    checkpoint can save and restore them; ``step`` counts the optimizer steps
    done (an fp16 step the scaler skipped does not count, and is tallied in
    ``skipped_steps``); ``history`` holds one dict per logged step.
    """

    def __init__(self, model: nn.Module, config: TrainConfig, device: torch.device) -> None:
        device = torch.device(device)
        _check_on_device(model, device)
        self.model = model
        self.config = config
        self.device = device
        self.autocast_dtype = AUTOCAST_DTYPES[config.precision]
        self.optimizer = torch.optim.AdamW(
            parameter_groups(model, config.weight_decay), lr=config.lr, betas=config.betas
        )

        def lr_factor(step: int) -> float:  # LambdaLR multiplies the base lr by this
            return learning_rate(step, config) / config.lr

        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_factor)
        # Loss scaling only for fp16: its exponent range is so narrow that small gradients
        # underflow to zero. bf16 has fp32's exponent range and needs none.
        self.scaler = torch.amp.GradScaler(device.type, enabled=config.precision == "fp16")
        self.step = 0
        self.skipped_steps = 0
        self.history: list[dict] = []
        # Per-step values since the last history row, still on the device: (step, loss, grad_norm, tokens).
        self._unlogged: list[tuple[int, Tensor, Tensor, Tensor]] = []
        self._interval_started = time.perf_counter()

    # ----- one optimizer step, in its named parts -----

    def accumulate_gradients(self, micro_batches: Sequence[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
        """Forward and backward over ``micro_batches``; returns (mean loss, target tokens) as tensors.

        Each micro-batch's loss is summed over its tokens and divided by the
        target-token count of *all* the micro-batches, so the accumulated
        gradient is the gradient of the mean loss over every token of the step:
        exactly what one big batch would give, whatever the micro-batch sizes
        or how the ignored tokens are spread among them.
        """
        batches = [(x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True))
                   for x, y in micro_batches]
        # 1. count: a tensor on the device, so no sync; at least 1 so an all-ignored step gives loss 0.
        target_tokens = sum((y != IGNORE_INDEX).sum() for _, y in batches).clamp(min=1)
        step_loss = torch.zeros((), device=self.device)
        self.model.train()
        for x, y in batches:
            # 2. forward in low precision, loss in float32 (log-softmax over a large vocabulary
            #    loses digits in bf16/fp16).
            with torch.autocast(self.device.type, dtype=self.autocast_dtype,
                                enabled=self.config.precision != "fp32"):
                logits = self.model(x)
            loss = F.cross_entropy(logits.float().flatten(0, -2), y.flatten(),
                                   ignore_index=IGNORE_INDEX, reduction="sum") / target_tokens
            # 3. backward; gradients add up in .grad across micro-batches.
            self.scaler.scale(loss).backward()
            step_loss += loss.detach()
        return step_loss, target_tokens

    def clip_gradients(self) -> Tensor:
        """Unscale the gradients (fp16) and clip their total norm; returns the norm before clipping.

        Unscaling first matters: clipping a scaled gradient would compare
        ``max_grad_norm`` with a norm that is ``scale`` times too large.
        """
        # 4. unscale, then clip
        self.scaler.unscale_(self.optimizer)
        parameters = [p for group in self.optimizer.param_groups for p in group["params"]]
        if self.config.max_grad_norm is None:
            return torch.nn.utils.get_total_norm([p.grad for p in parameters if p.grad is not None])
        return torch.nn.utils.clip_grad_norm_(parameters, self.config.max_grad_norm)

    def train_step(self, micro_batches: Sequence[tuple[Tensor, Tensor]]) -> None:
        """One optimizer step over ``micro_batches`` (usually ``accum_steps`` of them, fewer at the end).

        Parts 1-3 (count, forward and loss, backward) are in ``accumulate_gradients``,
        part 4 (unscale, clip) in ``clip_gradients``; parts 5-7 follow here. With
        fp16 the scaler may skip the step (a gradient overflowed): then ``step``
        does not advance and ``skipped_steps`` does.
        """
        if len(micro_batches) == 0:
            raise ValueError("Trainer.train_step: got no micro-batches; a step needs at least one")
        step_loss, target_tokens = self.accumulate_gradients(micro_batches)
        grad_norm = self.clip_gradients()
        # 5. step (skipped by the scaler if an fp16 gradient is inf/nan), then update the scale.
        scale_before = self.scaler.get_scale() if self.scaler.is_enabled() else None
        self.scaler.step(self.optimizer)
        self.scaler.update()
        # The scaler halves its scale exactly when it skipped the step (a sync, but fp16's
        # scaler.step has already synced to look for infs).
        skipped = scale_before is not None and self.scaler.get_scale() < scale_before
        # 6. schedule: the next step's learning rate; a skipped step does not advance it.
        if not skipped:
            self.scheduler.step()
        # 7. zero: None instead of a tensor of zeros; the next backward writes instead of adding.
        self.optimizer.zero_grad(set_to_none=True)
        if skipped:
            self.skipped_steps += 1
            return
        self.step += 1
        self._unlogged.append((self.step, step_loss, grad_norm.detach(), target_tokens))
        if self.step % self.config.log_every == 0:
            self.log()

    def log(self) -> dict | None:
        """Read the losses since the last row to the host (a sync) and append a history row.

        Raises ``NonFiniteLossError`` naming the first step whose loss was NaN
        or infinite. Returns the new row, or None if no step ran since the last one.
        """
        if not self._unlogged:
            return None
        steps = [entry[0] for entry in self._unlogged]
        losses, norms, tokens = (torch.stack([entry[i] for entry in self._unlogged]).tolist()
                                 for i in (1, 2, 3))
        now = time.perf_counter()
        bad = [(step, loss) for step, loss in zip(steps, losses) if not math.isfinite(loss)]
        if bad:
            raise NonFiniteLossError(
                f"training loss is {bad[0][1]} at optimizer step {bad[0][0]} "
                f"(noticed at step {steps[-1]}, when the losses were read); precision="
                f"{self.config.precision!r}, lr={learning_rate(bad[0][0] - 1, self.config):.3g}. "
                "Lower the learning rate or look for bad inputs, and resume from a checkpoint "
                "taken before that step."
            )
        row = {
            "step": steps[-1],
            "loss": sum(losses) / len(losses),
            "lr": learning_rate(steps[-1] - 1, self.config),  # the rate the logged step used
            "grad_norm": sum(norms) / len(norms),
            "tokens_per_second": sum(tokens) / max(now - self._interval_started, 1e-9),
        }
        self.history.append(row)
        self._unlogged.clear()
        self._interval_started = now
        return row

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

    def fit(
        self,
        train_batches: Iterator[tuple[Tensor, Tensor]],
        val_batches: Callable[[], Iterable[tuple[Tensor, Tensor]]] | None = None,
    ) -> list[dict]:
        """Train until ``config.max_steps`` steps are done or ``train_batches`` runs out.

        Micro-batches are taken ``accum_steps`` at a time; a shorter group left at
        the end of the data is still one (correctly normalised) step.
        ``val_batches()`` is called for fresh validation batches every
        ``eval_every`` steps and after the last step; its loss is added to that
        step's history row as ``val_loss``.
        """
        train_batches = iter(train_batches)
        while self.step < self.config.max_steps:
            group = list(itertools.islice(train_batches, self.config.accum_steps))
            if not group:
                break
            steps_before = self.step
            self.train_step(group)
            stepped = self.step > steps_before  # False when the fp16 scaler skipped the step
            if val_batches is not None and stepped and self.step % self.config.eval_every == 0:
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
