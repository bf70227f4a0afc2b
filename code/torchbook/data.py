"""The token pipeline: token ids on disk as shards, streamed back as ``(x, y)`` batches.

1. ``TokenDataset``: the map-style dataset most tutorials write (item ``i`` is the block
   starting at ``i * block_size`` of a Python list). Correct and slow: every token
   passes through the Python interpreter on every read.
2. Shards on disk (``torchbook.shards``): ids in ``.bin`` files with a header, mapped
   with ``np.memmap``.
3. ``TokenStream``: an ``IterableDataset`` of whole batches. Each shard is viewed,
   without copying, as a table whose rows are its blocks, so a batch is one gather of
   rows per shard it touches. Use it with ``DataLoader(stream, batch_size=None)``.

How the stream divides the work: a *block* is ``block_size + 1`` tokens starting at a
multiple of ``block_size`` inside one shard. Each epoch orders all blocks (a permutation
seeded by ``(seed, epoch)``, the same on every process, or file order), cuts the order
into global batches, deals global batch ``g`` to rank ``g % world_size`` and the rank's
``k``-th batch to DataLoader worker ``k % num_workers``; the DataLoader collects round
robin, so the loop sees the same order for any number of workers. Every rank must take
the same number of steps or DDP hangs, so an epoch uses the largest multiple of
``world_size * batch_size`` blocks and reports the rest (``dropped_blocks_per_epoch``).

It builds on ``torchbook.shards`` (reading the shards it streams).

Resuming: workers prefetch, so only the training loop knows how many batches it
consumed. It passes that count to ``state_dict(batches_consumed)``; a fresh stream given
``load_state_dict(state)`` starts at the next batch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from torchbook.shards import ShardError, open_shard, read_header


# ------------------------------------------------------------ 1. The tutorial version
class TokenDataset(Dataset):
    """Map-style dataset of a token list: item ``i`` is the block at ``i * block_size``.

    The version most tutorials write, kept to be measured: each item copies
    ``2 * block_size`` Python ints into two new tensors, one by one. Its blocks are
    exactly ``TokenStream``'s over one shard in file order. A package class, so
    DataLoader workers started with ``spawn`` can unpickle it (a class defined in a
    notebook cannot be).
    """

    def __init__(self, tokens: Sequence[int], block_size: int) -> None:
        if block_size <= 0 or len(tokens) < block_size + 1:
            raise ShardError(
                f"TokenDataset: block_size={block_size} needs {block_size + 1} "
                f"tokens; got {len(tokens)}"
            )
        self.tokens, self.block_size = tokens, block_size

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start, end = i * self.block_size, (i + 1) * self.block_size
        return torch.tensor(self.tokens[start:end]), torch.tensor(
            self.tokens[start + 1 : end + 1]
        )


# ------------------------------------------------------------ 3. Streaming from shards
@dataclass(frozen=True)
class StreamConfig:
    """How ``TokenStream`` cuts, orders and divides the blocks."""

    block_size: int = 256
    batch_size: int = 32
    # seeded random order of blocks, new each epoch; False: file order
    shuffle: bool = True
    seed: int = 0
    epochs: int | None = 1  # None: repeat epochs forever (count steps, not epochs)
    rank: int = 0  # this process's rank in distributed training
    world_size: int = 1


# Fields a saved position must agree on; any difference changes which batch comes next.
_POSITION_KEYS = ("block_size", "batch_size", "shuffle", "seed", "world_size", "rank")


class TokenStream(IterableDataset):
    """Yield int64 ``(x, y)`` batches of shape ``(batch_size, block_size)`` from shards.

    ``y`` is ``x`` shifted by one token. Use with
    ``DataLoader(stream, batch_size=None, num_workers=...)``; every worker and every
    rank reads disjoint batches (see the module docstring). Shards are validated in the
    constructor and mapped lazily in each worker; a shard rewritten with another length
    in between is refused, not read past its end.
    """

    def __init__(self, shards: Sequence[Path | str], config: StreamConfig) -> None:
        self.paths, self.config, block = (
            [Path(p) for p in shards],
            config,
            config.block_size,
        )
        if (
            not shards
            or min(block, config.batch_size) <= 0
            or not 0 <= config.rank < config.world_size
        ):
            raise ShardError(
                f"TokenStream: {len(shards)} shards and {config}; expected at least "
                "one shard, positive block_size and batch_size, and "
                "0 <= rank < world_size"
            )
        self.headers, names = (
            [read_header(p) for p in self.paths],
            ", ".join(map(str, self.paths)),
        )
        if len(kinds := {(h.tokenizer, h.vocab_size) for h in self.headers}) > 1:
            raise ShardError(
                f"{names}: ids of {len(kinds)} tokenizers {sorted(kinds)}; a stream "
                "reads one tokenizer's"
            )
        counts = np.array([h.num_tokens for h in self.headers], dtype=np.int64)
        # A block needs block_size + 1 tokens; consecutive blocks share one token.
        blocks_per_shard = self.blocks_per_shard = np.maximum((counts - 1) // block, 0)
        self.num_blocks = int(blocks_per_shard.sum())
        self.block_shard = np.repeat(
            np.arange(len(self.paths), dtype=np.int32), blocks_per_shard
        )
        self.block_start = np.concatenate(
            [np.arange(n, dtype=np.int64) * block for n in blocks_per_shard]
        )
        # Tokens after each shard's last full block (a whole shard, if it is too short)
        # are in no x or y.
        self.unused_tail_tokens = int(
            (
                counts - np.where(blocks_per_shard > 0, blocks_per_shard * block + 1, 0)
            ).sum()
        )
        per_step = config.world_size * config.batch_size
        self.batches_per_epoch = self.num_blocks // per_step  # on each rank
        if self.batches_per_epoch == 0:
            raise ShardError(
                f"{names}: {self.num_blocks:,} blocks of block_size={block} (each "
                f"needs {block + 1} tokens in a shard; the longest has "
                f"{counts.max():,}), under one step of {per_step} blocks"
            )
        self.dropped_blocks_per_epoch = (
            self.num_blocks - self.batches_per_epoch * per_step
        )
        # None: forever
        self.total_batches = (
            None if config.epochs is None else config.epochs * self.batches_per_epoch
        )
        # position to resume from, in batches this rank has consumed
        self.start_batch = 0
        # each shard viewed as blocks, made lazily once per process
        self._blocks: list[np.ndarray] | None = None

    # -- positions
    def state_dict(self, batches_consumed: int) -> dict:
        """The position after the loop has consumed ``batches_consumed`` batches.

        Count from the very start of training (not from the last resume). The
        configuration is saved too: a stream that would order batches differently
        refuses the position rather than skip data.
        """
        return {key: getattr(self.config, key) for key in _POSITION_KEYS} | {
            "num_blocks": self.num_blocks,
            "batches_consumed": batches_consumed,
        }

    def load_state_dict(self, state: dict) -> None:
        """Make the next iteration start after ``state``'s ``batches_consumed``."""
        expected = self.state_dict(0)
        if not isinstance(state, dict) or set(state) != set(expected):
            raise ValueError(
                f"stream state {state!r:.80} lacks or adds to the keys "
                f"{sorted(expected)} of TokenStream.state_dict"
            )
        differs = [
            f"{key} saved {state[key]!r} but this stream has {value!r}"
            for key, value in expected.items()
            if key != "batches_consumed" and state[key] != value
        ]
        position, total = state["batches_consumed"], self.total_batches
        if type(position) is not int or not 0 <= position <= (
            position if total is None else total
        ):
            differs.append(
                f"batches_consumed={position!r}, expected an int in 0..{total}"
            )
        if differs:
            raise ValueError(f"cannot resume this stream: {', '.join(differs)}")
        self.start_batch = position

    def __len__(self) -> int:
        """Batches one iteration yields on this rank from the current start position."""
        if self.total_batches is None:
            raise TypeError(
                "TokenStream with epochs=None repeats forever and has no length"
            )
        return self.total_batches - self.start_batch

    # -- order
    def epoch_order(self, epoch: int) -> np.ndarray:
        """All block ids of ``epoch`` in reading order (before dealing them to ranks).

        Seeded by the pair ``(seed, epoch)``, so seed 1 epoch 0 and seed 0
        epoch 1 are different orders (``seed + epoch`` would make them equal).
        """
        order = (
            np.random.default_rng((self.config.seed, epoch)).permutation
            if self.config.shuffle
            else np.arange
        )
        return order(self.num_blocks)

    def rank_batches(self, epoch: int) -> np.ndarray:
        """This rank's block ids in ``epoch``: ``(batches_per_epoch, batch_size)``."""
        cfg = self.config
        used = self.batches_per_epoch * cfg.world_size * cfg.batch_size
        global_batches = self.epoch_order(epoch)[:used].reshape(-1, cfg.batch_size)
        # Within a batch, read blocks in file order (block ids run shard by shard): the
        # rows' order does not change the batch's gradient, and each shard's blocks
        # become one contiguous slice.
        return np.sort(global_batches[cfg.rank :: cfg.world_size], axis=1)

    # -- reading
    def __getstate__(self) -> dict:
        # Pickled into DataLoader workers (spawn on macOS/Windows): send paths, never
        # the mapped data.
        return {**self.__dict__, "_blocks": None}

    def _block_views(self) -> list[np.ndarray]:
        """Each shard's memmap viewed, read-only, as a table whose rows are its blocks.

        Nothing is copied (consecutive rows share one token); a batch is a gather of
        whole rows.
        """
        block, views = self.config.block_size, []
        for path, header, rows in zip(
            self.paths, self.headers, self.blocks_per_shard, strict=True
        ):
            tokens = open_shard(path)
            if (len(tokens), tokens.dtype.name) != (header.num_tokens, header.dtype):
                raise ShardError(
                    f"{path}: holds {len(tokens):,} {tokens.dtype} tokens, but "
                    f"{header.num_tokens:,} {header.dtype} when this stream was built; "
                    "it was rewritten: build a new stream"
                )
            views.append(
                np.lib.stride_tricks.as_strided(
                    tokens,
                    shape=(int(rows), block + 1),
                    writeable=False,
                    strides=(block * tokens.itemsize, tokens.itemsize),
                )
            )
        return views

    def _gather(self, block_ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Read sorted ``block_ids`` as int64 ``(x, y)``, one gather per shard."""
        # mapped on first use, in each worker
        self._blocks = self._blocks or self._block_views()
        # non-decreasing: rank_batches sorts each batch
        shard_of = self.block_shard[block_ids]
        # the block's row in its shard's view
        row_of = self.block_start[block_ids] // self.config.block_size
        # the common case with large shards: one gather of whole rows
        if shard_of[0] == shard_of[-1]:
            rows = self._blocks[shard_of[0]][row_of]
        else:  # one gather per shard (np.take would copy the whole overlapping view)
            # where the shard changes
            cuts = [
                0,
                *(np.flatnonzero(np.diff(shard_of)) + 1),
                len(block_ids),
            ]
            rows = np.concatenate(
                [
                    self._blocks[shard_of[first]][row_of[first:end]]
                    for first, end in pairwise(cuts)
                ]
            )
        # astype copies, so x and y come out contiguous (y.view(-1) works) and writable.
        return torch.from_numpy(rows[:, :-1].astype(np.int64)), torch.from_numpy(
            rows[:, 1:].astype(np.int64)
        )

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        worker = get_worker_info()
        num_workers, worker_id = (
            (1, 0) if worker is None else (worker.num_workers, worker.id)
        )
        # this worker's first batch
        position, current_epoch = (
            self.start_batch + worker_id,
            None,
        )
        while self.total_batches is None or position < self.total_batches:
            epoch, batch = divmod(position, self.batches_per_epoch)
            if epoch != current_epoch:
                batches, current_epoch = self.rank_batches(epoch), epoch
            yield self._gather(batches[batch])
            position += num_workers
