"""charlm's random windows: every valid start can be drawn, and each target is its input shifted by one."""

from __future__ import annotations

import torch

from torchbook.charlm import random_blocks


def test_random_blocks_draws_every_window_including_the_last():
    block_size = 4
    source = torch.arange(block_size + 3)  # three valid windows, starting at 0, 1 and 2
    batches = random_blocks(source, block_size, batch_size=64, generator=torch.Generator().manual_seed(0))
    x, _ = next(batches)
    # The chance that 64 uniform draws miss one of 3 starts is 3 * (2/3)**64, about 2e-11.
    assert set(x[:, 0].tolist()) == {0, 1, 2}


def test_a_source_of_exactly_one_window_gives_that_window():
    block_size = 4
    source = torch.arange(block_size + 1)
    x, y = next(random_blocks(source, block_size, batch_size=2, generator=torch.Generator().manual_seed(0)))
    assert torch.equal(x, source[:-1].expand(2, -1)) and torch.equal(y, source[1:].expand(2, -1))
