"""A language model's loss as the book computes it: float32, summed, chunked.

Three decisions, each for a reason the training loop relies on:

- **Float32.** The forward runs under ``torch.autocast`` in the run's
  precision, but the cross-entropy is taken outside it, on logits cast to
  float32: a log-softmax over a vocabulary of tens of thousands of tokens
  loses digits in bf16 and fp16, and a bf16 loss is itself a bf16 number.
- **Summed, not averaged.** ``summed_loss`` adds the loss over the target
  tokens, skipping those labelled ``IGNORE_INDEX`` (padding, prompts), and
  leaves the division to its caller. A step over several micro-batches
  divides by the token count of all of them, so the accumulated gradient
  is exactly one big batch's however the ignored tokens fall; a mean per
  micro-batch would weight the tokens of a sparse micro-batch more.
- **Chunked, when the vocabulary is large.** With ``loss_chunks`` > 1 the
  (tokens, vocab_size) float32 logits, often the largest tensor of a
  step, never exist at once: the model returns its final hidden states,
  and the head and the loss run over slices of the sequence under
  ``torch.utils.checkpoint``.

It builds on ``torchbook.chat`` (``IGNORE_INDEX``, the label the loss
skips) and ``torchbook.state_dicts`` (the head of a compiled or DDP model).
The training loop's ``Trainer`` and ``evaluate`` call it, and so does the
memory measurement, which needs the book's forward and loss without the
training loop.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from torchbook.chat import IGNORE_INDEX  # targets not scored: padding, prompts
from torchbook.device import autocast
from torchbook.state_dicts import unwrap_model


def summed_loss(
    model: nn.Module, x: Tensor, y: Tensor, precision: str, loss_chunks: int = 1
) -> Tensor:
    """The forward under autocast in ``precision``, then the cross-entropy *summed*.

    The sum runs over ``y``'s target tokens, so that the step can divide by
    the token count of all its micro-batches. The loss is taken outside
    autocast, on logits cast to float32: log-softmax over a large
    vocabulary loses digits in bf16 and fp16. With ``loss_chunks`` > 1 (a
    GPT) the model returns its final hidden states, and the head and the
    loss run over that many slices of the sequence, each under
    ``checkpoint``: one slice's float32 logits exist at a time, in the
    backward pass too, instead of all (tokens, vocab_size) of them.
    """
    with autocast(x.device.type, precision):
        out = model(x) if loss_chunks == 1 else model(x, return_hidden=True)
    if loss_chunks == 1:
        return _cross_entropy_sum(out, y)
    head = unwrap_model(model).lm_head
    pieces = zip(
        out.chunk(loss_chunks, dim=1), y.chunk(loss_chunks, dim=1), strict=True
    )
    return sum(
        checkpoint(_head_loss, head, h, t, precision, use_reentrant=False)
        for h, t in pieces
    )


def _cross_entropy_sum(logits: Tensor, y: Tensor) -> Tensor:
    """The float32 cross-entropy summed over the targets that are not ignored."""
    return F.cross_entropy(
        logits.float().flatten(0, -2),
        y.flatten(),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def _head_loss(head: nn.Module, hidden: Tensor, y: Tensor, precision: str) -> Tensor:
    """One slice of a chunked loss: head under autocast, cross-entropy in float32."""
    with autocast(hidden.device.type, precision):
        logits = head(hidden)
    return _cross_entropy_sum(logits, y)
