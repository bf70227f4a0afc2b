"""What the book's two decoder-only models share, as functions on tensors.

The book's GPT and its Llama-family model differ in their norms, their
MLPs and their attention heads, but they place
tokens, mask attention, check their inputs and start their weights the
same way. Those pieces live here, so that each model's module reads as its
architecture and nothing else:

- **RoPE**, rotary position embeddings (Su et al. 2021): ``rope_tables``
  computes a cosine and a sine for every position and feature pair, and
  ``apply_rope`` rotates each pair of a query or a key by its position's
  angle. A rotated query-key score then depends on how far apart the two
  tokens are, not on where they sit, and the model has no position
  parameters. The layout is "split halves" (GPT-NeoX, Llama and the
  Hugging Face checkpoints): feature i pairs with feature i + head_size/2.
- **Masks**: ``document_causal_mask`` for rows that pack several
  documents (causal inside each, blind across them), and
  ``masked_softmax_attention``, attention written out with a boolean mask:
  the textbook computation that ``F.scaled_dot_product_attention`` fuses,
  kept as the reference that tests and chapters compare SDPA with.
- **Checks**: ``check_token_ids`` and ``check_positions`` refuse an id
  outside the embedding, or a position outside RoPE's tables, with an
  error that names the value, where it sits and what was expected.
  Without them a bad id fails inside the embedding's lookup, as an
  ``IndexError`` that names neither on the CPU and, on CUDA, as a
  device-side assert inside the kernel. Reading the smallest and largest
  id is free for a tensor on the host, but on an accelerator it waits for
  every queued kernel, so call them on a batch before ``.to(device)``.
- **Initialisation**: ``init_weights``, GPT-2's single small standard
  deviation for every linear and embedding weight, which Hugging Face's
  Llama uses too.

It imports only torch (plus math): copy it into a project as it is.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

# Standard deviation of every weight at initialisation (GPT-2's): the first
# logits are nearly uniform, so the first loss is close to log(vocab_size).
INIT_STD = 0.02
# RoPE's base: rotation frequencies run from 1 down to about 1/ROPE_BASE
# radians per position, as in the RoFormer paper and most open LLMs.
ROPE_BASE = 10_000.0


# ----- positions: RoPE -----


def rope_tables(
    head_size: int,
    block_size: int,
    base: float = ROPE_BASE,
    inv_freq: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosine and sine tables, each (block_size, head_size), for RoPE.

    Feature pair i of position t turns by t * inv_freq[i]: by default
    base**(-2i/head_size), so the first pair turns one radian per position
    and the last about 1/base; or the frequencies given (Llama 3 rescales
    them), on their device. The angles are computed in float32, whatever
    the model's dtype: an angle is a position times a frequency, and bf16
    would round each product to 8 significant bits, an error that grows
    with the position. Both halves carry the same angles, as
    ``rotate_half`` below expects (the "split halves" convention of
    GPT-NeoX and Llama).
    """
    if inv_freq is None:
        pairs = torch.arange(0, head_size, 2, dtype=torch.float32)
        inv_freq = base ** (-pairs / head_size)
    positions = torch.arange(block_size, dtype=torch.float32, device=inv_freq.device)
    angles = torch.outer(positions, inv_freq)  # (block_size, head_size/2)
    angles = torch.cat((angles, angles), dim=-1)  # (block_size, head_size)
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate queries or keys ``x`` (B, H, T, head_size) by their positions' angles.

    The tables stay float32 under autocast; the result is cast back to x's dtype
    so that q, k and v reach attention with one dtype.
    """
    return (x * cos + rotate_half(x) * sin).to(x.dtype)


# ----- masks: who may attend to whom -----


def document_causal_mask(
    document_ids: torch.Tensor, causal_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """(B, 1, T, T) bool for packed rows: a query sees its own document's past only.

    ``causal_mask`` (True on and below the diagonal: the GPT's buffer, or built
    here) AND "same document"; the size-1 dimension broadcasts over the heads.
    """
    steps = document_ids.size(1)
    same_document = document_ids[:, :, None] == document_ids[:, None, :]
    if causal_mask is None:
        causal_mask = torch.ones_like(same_document[0]).tril()
    return (causal_mask[:steps, :steps] & same_document).unsqueeze(1)


def masked_softmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    dropout_p: float = 0.0,
    training: bool = False,
) -> torch.Tensor:
    """Attention written out: softmax(q k^T / sqrt(d) with masked scores at -inf) v.

    ``mask`` is boolean, True where a query may look at a key. This is the
    textbook computation that ``F.scaled_dot_product_attention(..., is_causal=True)``
    replaces with a fused kernel that never materialises the (T, T) scores; it is
    the reference that tests and chapters compare SDPA with.
    """
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = F.dropout(scores.softmax(dim=-1), p=dropout_p, training=training)
    return weights @ v


# ----- checks on the host: ids and positions -----


def _check_range(ids: torch.Tensor, limit: int, what: str, expected: str) -> None:
    """Raise ValueError naming the first value of ``ids`` outside ``[0, limit)``."""
    if ids.numel() == 0:
        return
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= limit:
        bad = low if low < 0 else high
        index = tuple(int(i) for i in (ids == bad).nonzero()[0])
        raise ValueError(f"{what} {bad} at position {index}, outside {expected}")


def check_token_ids(
    ids: torch.Tensor, vocab_size: int, where: str = "token ids"
) -> None:
    """Raise ValueError naming ``where`` and its first id outside ``[0, vocab_size)``.

    Call it on host tensors (a data pipeline's batch before ``.to(device)``):
    on an accelerator, reading ``ids.min()`` and ``ids.max()`` back waits for
    every queued kernel. It matters most there: on CUDA, an embedding lookup
    with an id out of range is a device-side assert, after which the process
    can run no more CUDA work, and the error names neither the id nor the
    vocabulary.
    """
    tokenizer = "was the data tokenized with another tokenizer?"
    expected = f"the vocabulary [0, {vocab_size}); {tokenizer}"
    _check_range(ids, vocab_size, f"{where} holds token id", expected)


def check_positions(
    position_ids: torch.Tensor, block_size: int, where: str = "position_ids"
) -> None:
    """Raise ValueError naming ``where`` and its first position outside the tables.

    RoPE's tables have a row per position, ``[0, block_size)``; indexing them
    with a negative position would silently read a row from the end.
    """
    what = f"{where} holds"
    _check_range(position_ids, block_size, what, f"[0, {block_size=})")


# ----- initialisation -----


def init_weights(module: nn.Module) -> None:
    """Normal(0, 0.02) for linear and embedding weights, zero biases (``apply`` it).

    PyTorch's default ``Linear`` initialisation depends on the fan-in, and its
    ``Embedding`` draws from N(0, 1): with a head tied to the embedding, N(0, 1)
    embeddings would make the first logits huge and the first predictions
    confidently wrong. GPT-2's single small standard deviation gives
    near-uniform first predictions, so training starts near
    loss = log(vocab_size). Norm layers keep their default (weight 1, bias 0).
    """
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
