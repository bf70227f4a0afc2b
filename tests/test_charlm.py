"""charlm: the windows it draws, its targets, and its loop's validation.

Every valid window can be drawn, each target is its input shifted by one, and the
run's own loop validates each completed step once.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from torchbook.book import charlm
from torchbook.book.charlm import load_corpus, random_blocks
from torchbook.book.profiles import LanguageModelSizes


def test_random_blocks_draws_every_window_including_the_last():
    block_size = 4
    source = torch.arange(block_size + 3)  # three valid windows, starting at 0, 1 and 2
    batches = random_blocks(
        source, block_size, batch_size=64, generator=torch.Generator().manual_seed(0)
    )
    x, _ = next(batches)
    # The chance that 64 uniform draws miss one of 3 starts: 3 * (2/3)**64, about 2e-11.
    assert set(x[:, 0].tolist()) == {0, 1, 2}


def test_a_source_of_exactly_one_window_gives_that_window():
    block_size = 4
    source = torch.arange(block_size + 1)
    x, y = next(
        random_blocks(
            source, block_size, batch_size=2, generator=torch.Generator().manual_seed(0)
        )
    )
    assert torch.equal(x, source[:-1].expand(2, -1)) and torch.equal(
        y, source[1:].expand(2, -1)
    )


def test_a_text_too_short_to_split_is_refused_with_its_path(tmp_path):
    path = tmp_path / "one_character.txt"
    path.write_text("a", encoding="utf-8")
    with pytest.raises(ValueError, match="one_character.txt: text of length 1"):
        load_corpus(path)


def test_a_step_the_fp16_scaler_skips_is_not_validated_twice(tmp_path, monkeypatch):
    """The loop validates each completed step once.

    A step the fp16 scaler skips leaves ``trainer.step`` where it was.
    """
    text = tmp_path / "text.txt"
    text.write_text("to be or not to be, that is the question\n" * 20, encoding="utf-8")
    sizes = dataclasses.replace(
        LanguageModelSizes(),
        block_size=8,
        n_layer=1,
        n_head=2,
        d_model=16,
        batch_size=4,
        max_steps=3,
        warmup_steps=1,
        eval_every=1,
        eval_batches=1,
        log_every=1,
    )
    validated, real_build = [], charlm.build

    def build_with_one_overflow(*args):
        trainer = real_build(*args)
        backward_calls = []

        def overflow_on_second_backward(grad: torch.Tensor) -> torch.Tensor:
            backward_calls.append(1)
            return (
                torch.full_like(grad, float("inf"))
                if len(backward_calls) == 2
                else grad
            )

        trainer.model.ln_final.weight.register_hook(overflow_on_second_backward)
        add_val_loss = trainer.add_val_loss
        trainer.add_val_loss = lambda batches: (
            validated.append(trainer.step) or add_val_loss(batches)
        )
        return trainer

    monkeypatch.setattr(charlm, "build", build_with_one_overflow)
    run = charlm.train_char_lm(
        load_corpus(text), sizes, torch.device("cpu"), "fp16", seed=0
    )
    assert run.trainer.skipped_steps == 1 and run.trainer.step == 3, (
        "the test needs exactly one skipped step"
    )
    assert validated == [1, 2, 3], (
        f"expected one validation per completed step, got {validated}"
    )
    assert [row["step"] for row in run.trainer.history if "val_loss" in row] == [
        1,
        2,
        3,
    ]
