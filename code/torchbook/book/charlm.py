"""A character-level language model on Tiny Shakespeare: corpus, batches and one run.

Chapter 3 trains this model live at the profile's sizes, and
``examples/gpu_results.py`` trains it at full size on a GPU; both go through
``train_char_lm`` so the live run and the stored one are the same experiment.

The vocabulary is the set of characters in the text (65 for Tiny
Shakespeare). The first 90% of the text trains, the rest validates. Training
batches are random windows of ``block_size + 1`` characters drawn from a
seeded generator, every start from 0 to ``len - block_size - 1`` equally likely
(the input is the first ``block_size``, the target the same window shifted by
one); validation uses fixed windows from its own seed, so
every evaluation scores the same text.

It builds on ``torchbook.models`` (the GPT), ``torchbook.train`` (the ``Trainer``)
and ``torchbook.book.profiles`` (the sizes);
the precision is one of ``torchbook.device.AUTOCAST_DTYPES``'s keys.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from torchbook.book.profiles import LanguageModelSizes
from torchbook.device import synchronize
from torchbook.models import GPT, GPTConfig
from torchbook.train import TrainConfig, Trainer

VALIDATION_FRACTION = 0.1  # the last 10% of the text


@dataclass(frozen=True)
class CharCorpus:
    """A text as character ids, split into training and validation ids."""

    text: str
    vocabulary: list[str]  # id -> character, sorted
    train_tokens: Tensor  # int64 ids of the first (1 - VALIDATION_FRACTION) of the text
    val_tokens: Tensor

    @property
    def char_to_id(self) -> dict[str, int]:
        return {char: index for index, char in enumerate(self.vocabulary)}

    def decode(self, ids: list[int]) -> str:
        return "".join(self.vocabulary[i] for i in ids)


def load_corpus(path: str | Path) -> CharCorpus:
    """Read a UTF-8 text and encode it character by character."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    if len(text) < 2:
        raise ValueError(
            f"{path}: text of length {len(text)}; a corpus needs 2 characters or more"
        )
    vocabulary = sorted(set(text))
    lookup = {char: index for index, char in enumerate(vocabulary)}
    ids = torch.tensor([lookup[char] for char in text], dtype=torch.int64)
    split_at = int(len(ids) * (1 - VALIDATION_FRACTION))
    return CharCorpus(
        text=text,
        vocabulary=vocabulary,
        train_tokens=ids[:split_at],
        val_tokens=ids[split_at:],
    )


def unigram_baseline(corpus: CharCorpus) -> float:
    """Validation loss (nats/char) of predicting each character by its frequency."""
    counts = torch.bincount(
        corpus.train_tokens, minlength=len(corpus.vocabulary)
    ).double()
    log_probs = (counts / counts.sum()).log()
    return -log_probs[corpus.val_tokens].mean().item()


def random_blocks(
    source: Tensor, block_size: int, batch_size: int, generator: torch.Generator
) -> Iterator[tuple[Tensor, Tensor]]:
    """Endless (x, y) batches of random windows of ``source``; y is x shifted by one."""
    if len(source) < block_size + 1:
        raise ValueError(
            f"random_blocks: {len(source)} tokens cannot hold a window of "
            f"block_size + 1 = {block_size + 1}"
        )
    offsets = torch.arange(block_size + 1)
    # randint's high is exclusive: the last window starts at len - block_size - 1
    while True:
        starts = torch.randint(
            0, len(source) - block_size, (batch_size, 1), generator=generator
        )
        window = source[starts + offsets]  # (batch_size, block_size + 1)
        yield window[:, :-1], window[:, 1:]


def fixed_batches(
    source: Tensor, block_size: int, batch_size: int, count: int, seed: int
) -> list[tuple[Tensor, Tensor]]:
    """``count`` batches of windows drawn from ``seed``: the same text every time."""
    batches = random_blocks(
        source, block_size, batch_size, torch.Generator().manual_seed(seed)
    )
    return [next(batches) for _ in range(count)]


def model_config(vocab_size: int, sizes: LanguageModelSizes) -> GPTConfig:
    """Chapter 3's GPT at ``sizes`` for a vocabulary of ``vocab_size`` characters."""
    return GPTConfig(
        vocab_size=vocab_size,
        block_size=sizes.block_size,
        n_layer=sizes.n_layer,
        n_head=sizes.n_head,
        d_model=sizes.d_model,
        dropout=sizes.dropout,
    )


def train_config(sizes: LanguageModelSizes, precision: str) -> TrainConfig:
    """Chapter 3's loop at ``sizes``: schedule, logging and ``precision``."""
    return TrainConfig(
        max_steps=sizes.max_steps,
        lr=sizes.lr,
        min_lr=sizes.min_lr,
        warmup_steps=sizes.warmup_steps,
        precision=precision,
        log_every=sizes.log_every,
    )


def build(
    corpus: CharCorpus,
    sizes: LanguageModelSizes,
    device: torch.device,
    precision: str,
    seed: int,
) -> Trainer:
    """The GPT and its Trainer at ``sizes`` in ``precision``; weights from ``seed``.

    The one place chapter 3's configs are made: the GPU dry run and the fit
    table (``torchbook.book.dry_run``, ``torchbook.book.gpu_fit``) use the same two.
    """
    torch.manual_seed(seed)
    model = GPT(model_config(len(corpus.vocabulary), sizes)).to(device)
    return Trainer(model, train_config(sizes, precision), device)


@dataclass
class CharLMRun:
    """What one run leaves: the trainer (model, history) and its wall time."""

    trainer: Trainer
    train_seconds: float


def train_char_lm(
    corpus: CharCorpus,
    sizes: LanguageModelSizes,
    device: torch.device,
    precision: str,
    seed: int,
) -> CharLMRun:
    """Build the model at ``sizes`` and train it in ``precision`` (fp32, bf16, fp16).

    Validates at every ``eval_every``-th step and the last: a ``val_loss`` in that
    step's history row.
    """
    trainer = build(corpus, sizes, device, precision, seed)
    validation = fixed_batches(
        corpus.val_tokens,
        sizes.block_size,
        sizes.batch_size,
        sizes.eval_batches,
        seed + 1,
    )
    batches = random_blocks(
        corpus.train_tokens,
        sizes.block_size,
        sizes.batch_size,
        torch.Generator().manual_seed(seed),
    )
    started = time.perf_counter()
    while trainer.step < sizes.max_steps:
        result = trainer.train_step([next(batches)])
        # A step the fp16 scaler skipped leaves trainer.step as it was: no second eval.
        if not result.skipped and (
            trainer.step % sizes.eval_every == 0 or trainer.step == sizes.max_steps
        ):
            # writes this step's row, then adds its validation loss
            trainer.add_val_loss(validation)
    # the clock stops when the device has finished, not when the host has queued
    synchronize(device)
    return CharLMRun(trainer=trainer, train_seconds=time.perf_counter() - started)
