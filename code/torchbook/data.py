"""The token pipeline: token ids on disk as shards, streamed back as ``(x, y)`` batches.

1. ``TokenDataset``: the map-style dataset most tutorials write (item ``i`` is the block starting
   at ``i * block_size`` of a Python list). Correct and slow: every token passes through the
   Python interpreter on every read.
2. Shards: ``write_shard`` stores ids in one ``.bin`` file, a JSON header padded to
   ``HEADER_BYTES`` (dtype, token count, vocabulary size, tokenizer) followed by the ids, uint16
   when the vocabulary fits, else uint32; llm.c's shards have the same shape. ``open_shard``
   checks the header against the file's size and maps the ids with ``np.memmap``, both from one
   open file. ``cached_shards`` trusts a folder only when its index and every shard validate.
3. ``TokenStream``: an ``IterableDataset`` of whole batches. Each shard is viewed, without
   copying, as a table whose rows are its blocks, so a batch is one gather of rows per shard it
   touches. Use it with ``DataLoader(stream, batch_size=None)``.

Concurrency: a shard is one file replaced by one atomic rename, so a process that opens it while
another rewrites it reads the old shard or the new one, whole. ``cached_shards`` holds a lock on
its folder while it checks and rebuilds, so processes that ask for the same cache at once (DDP
ranks, two notebooks) build it once and all get it. Writing one folder with ``write_shards``
from several processes, or asking ``cached_shards`` for different contents of one folder at
once, is not supported: give each its own folder.

How the stream divides the work: a *block* is ``block_size + 1`` tokens starting at a multiple of
``block_size`` inside one shard. Each epoch orders all blocks (a permutation seeded by
``(seed, epoch)``, the same on every process, or file order), cuts the order into global batches,
deals global batch ``g`` to rank ``g % world_size`` and the rank's ``k``-th batch to DataLoader
worker ``k % num_workers``; the DataLoader collects round robin, so the loop sees the same order
for any number of workers. Every rank must take the same number of steps or DDP hangs, so an
epoch uses the largest multiple of ``world_size * batch_size`` blocks and reports the rest
(``dropped_blocks_per_epoch``).

Resuming: workers prefetch, so only the training loop knows how many batches it consumed. It
passes that count to ``state_dict(batches_consumed)``; a fresh stream given
``load_state_dict(state)`` starts at the next batch.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, fields
from itertools import pairwise
from pathlib import Path

import numpy as np
import torch
from filelock import FileLock  # installed with torch, which uses it too
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from torchbook.files import TEMPORARY_MARKER, atomic_write, atomic_write_text

SHARD_FORMAT = "torchbook-token-shard"
SHARD_VERSION = 2  # version 1 kept the header in a .json file beside the .bin
HEADER_BYTES = 1024  # the JSON header, padded with spaces; the ids start here, aligned for uint16 and uint32
UINT16_VOCAB_LIMIT = 1 << 16  # ids 0..65535 fit in two bytes


class ShardError(ValueError):
    """A shard or its index is missing, inconsistent, or does not fit the request."""


# ------------------------------------------------------------ 1. The tutorial version
class TokenDataset(Dataset):
    """Map-style dataset over a Python list of token ids: item ``i`` is the block starting at ``i * block_size``.

    The version most tutorials write, kept to be measured: each item copies ``2 * block_size``
    Python ints into two new tensors, one by one. Its blocks are exactly ``TokenStream``'s over
    one shard in file order. A package class, so DataLoader workers started with ``spawn`` can
    unpickle it (a class defined in a notebook cannot be).
    """

    def __init__(self, tokens: Sequence[int], block_size: int) -> None:
        if block_size <= 0 or len(tokens) < block_size + 1:
            raise ShardError(
                f"TokenDataset: block_size={block_size} needs {block_size + 1} tokens; got {len(tokens)}"
            )
        self.tokens, self.block_size = tokens, block_size

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start, end = i * self.block_size, (i + 1) * self.block_size
        return torch.tensor(self.tokens[start:end]), torch.tensor(
            self.tokens[start + 1 : end + 1]
        )


# ------------------------------------------------------------ 2. Shards on disk
@dataclass(frozen=True)
class ShardHeader:
    """What the first ``HEADER_BYTES`` of a shard say about the ids after them."""

    dtype: str  # "uint16" or "uint32"
    num_tokens: int
    vocab_size: int
    tokenizer: str  # file name or description of the tokenizer that produced the ids
    format: str = SHARD_FORMAT
    version: int = SHARD_VERSION


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every id of a vocabulary: uint16 up to 65,536 ids, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= UINT16_VOCAB_LIMIT else np.uint32)


def write_shard(
    path: Path | str,
    tokens: np.ndarray | Sequence[int],
    vocab_size: int,
    tokenizer: str,
) -> Path:
    """Write token ids to ``path`` (a ``.bin`` file) after their header; return the path.

    Every argument and id is checked before anything is written, and the file is written with
    ``atomic_write``: a crash leaves the old shard or the new one, never a part.
    """
    path, ids = Path(path), np.asarray(tokens)
    if (
        path.suffix != ".bin"
        or ids.ndim != 1
        or ids.size == 0
        or not np.issubdtype(ids.dtype, np.integer)
        or not isinstance(tokenizer, str)
        or type(vocab_size) is not int
        or not 0 < vocab_size <= 1 << 32
    ):
        raise ShardError(
            f"{path}: expected a .bin path, non-empty 1-D integer ids, vocab_size an int in 1..2**32 and "
            f"a tokenizer's name; got {ids.shape} {ids.dtype}, {vocab_size=!r:.20}, {tokenizer=!r:.16}"
        )
    dtype = token_dtype(vocab_size)
    if (bad := np.flatnonzero((ids < 0) | (ids >= vocab_size))).size:
        raise ShardError(
            f"{path}: token id {int(ids[bad[0]])} at position {bad[0]:,} is outside the vocabulary "
            f"[0, {vocab_size}); nothing was written"
        )
    header = json.dumps(
        asdict(ShardHeader(dtype.name, int(ids.size), vocab_size, tokenizer))
    ).encode("utf-8")
    if len(header) >= HEADER_BYTES:
        raise ShardError(
            f"{path}: a {len(header):,}-byte header does not fit in {HEADER_BYTES:,}; shorten tokenizer"
        )

    def write(temporary: Path) -> None:
        with open(temporary, "wb") as handle:
            # `head -c 1024 shard.bin` prints the header
            handle.write(header.ljust(HEADER_BYTES - 1) + b"\n")
            ids.astype(dtype).tofile(handle)

    return atomic_write(path, write)


# The header's fields and the Python type each must have.
_HEADER_TYPES = {
    field.name: {"str": str, "int": int}[field.type] for field in fields(ShardHeader)
}


def _read_header(path: Path) -> tuple[ShardHeader, np.memmap]:
    """Parse shard ``path``'s header, check it against the file's size and map the ids, all from one open file."""
    try:
        handle = open(path, "rb")
    except FileNotFoundError:
        raise ShardError(
            f"{path}: shard file is missing (expected a .bin written by write_shard)"
        ) from None
    with handle:
        try:  # not UTF-8 or JSON, a field missing or unknown, a vocabulary that is not an int in range
            entry = json.loads(handle.read(HEADER_BYTES).decode("utf-8"))
            header = ShardHeader(**entry)
            stored = token_dtype(header.vocab_size).name
        except (ValueError, TypeError, RecursionError) as error:
            raise ShardError(
                f"{path}: no shard header in its first {HEADER_BYTES:,} bytes ({error})"
            ) from None
        if (
            any(
                type(entry.get(name)) is not kind
                for name, kind in _HEADER_TYPES.items()
            )
            or (header.format, header.version, header.dtype)
            != (SHARD_FORMAT, SHARD_VERSION, stored)
            or min(header.num_tokens, header.vocab_size) <= 0
        ):
            raise ShardError(
                f"{path}: header {entry!r:.200} is not one write_shard writes: format {SHARD_FORMAT!r} "
                f"version {SHARD_VERSION}, dtype {stored} for this vocabulary, counts > 0"
            )
        expected = HEADER_BYTES + header.num_tokens * np.dtype(header.dtype).itemsize
        if (actual := os.fstat(handle.fileno()).st_size) != expected:
            raise ShardError(
                f"{path}: header says {header.num_tokens:,} {header.dtype} tokens ({expected:,} bytes "
                f"with the header) but the file has {actual:,} bytes; was the write interrupted?"
            )
        return header, np.memmap(
            handle,
            dtype=header.dtype,
            mode="r",
            offset=HEADER_BYTES,
            shape=(header.num_tokens,),
        )


def read_header(path: Path | str) -> ShardHeader:
    """Read and validate the header of shard ``path`` against the file's size."""
    return _read_header(Path(path))[0]


def open_shard(path: Path | str, check_ids: bool = False) -> np.memmap:
    """Validate shard ``path`` and map its ids read-only as a 1-D array.

    Header and ids come from one open file, so a shard replaced meanwhile is never half-read.
    ``check_ids=True`` also reads the whole shard once to confirm every id is below the
    vocabulary size (write_shard already checked when it wrote).
    """
    header, tokens = _read_header(Path(path))
    if check_ids and (bad := np.flatnonzero(tokens >= header.vocab_size)).size:
        raise ShardError(
            f"{path}: token id {int(tokens[bad[0]])} at position {bad[0]:,} is outside the vocabulary "
            f"[0, {header.vocab_size}) that its header declares"
        )
    return tokens


def index_path(folder: Path | str, prefix: str = "shard") -> Path:
    """The index ``write_shards`` writes last: ``<folder>/<prefix>_index.json``."""
    return Path(folder) / f"{prefix}_index.json"


def write_shards(
    tokens: np.ndarray | Sequence[int],
    folder: Path | str,
    vocab_size: int,
    tokenizer: str,
    tokens_per_shard: int,
    prefix: str = "shard",
) -> list[Path]:
    """Split ``tokens`` into shards of ``tokens_per_shard`` ids named ``<prefix>_000.bin``, ...; return their paths.

    The index ``<prefix>_index.json`` (shard names, total tokens, tokenizer) is
    removed first and written last, so it exists only when every shard does.
    """
    ids, folder = np.asarray(tokens), Path(folder)
    if (
        type(tokens_per_shard) is not int
        or tokens_per_shard <= 0
        or ids.ndim != 1
        or ids.size == 0
    ):
        raise ShardError(
            f"{folder}: {tokens_per_shard=!r} and ids of shape {ids.shape}; expected an int > 0, 1-D ids"
        )
    index = index_path(folder, prefix)
    index.unlink(missing_ok=True)
    paths = [
        write_shard(
            folder / f"{prefix}_{number:03d}.bin",
            ids[start : start + tokens_per_shard],
            vocab_size,
            tokenizer,
        )
        for number, start in enumerate(range(0, len(ids), tokens_per_shard))
    ]
    atomic_write_text(
        index,
        json.dumps(
            {
                "shards": [p.name for p in paths],
                "num_tokens": int(ids.size),
                "vocab_size": vocab_size,
                "tokenizer": tokenizer,
            },
            indent=2,
        )
        + "\n",
    )
    return paths


def read_shards(folder: Path | str, prefix: str = "shard") -> list[Path]:
    """The shards listed by ``folder``'s index, after validating the index and every shard against it."""
    return _read_index(Path(folder), prefix)[0]


def _read_index(folder: Path, prefix: str) -> tuple[list[Path], list[ShardHeader]]:
    index = index_path(folder, prefix)
    try:
        entry = json.loads(index.read_bytes().decode("utf-8"))
        names = list(entry["shards"])
        if not names or any(
            Path(name).name != name or not name.endswith(".bin") for name in names
        ):
            raise ValueError(f"field 'shards' is {names!r:.80}")
    # missing, not JSON, no list of names
    except (
        OSError,
        ValueError,
        TypeError,
        KeyError,
        RecursionError,
    ) as error:
        raise ShardError(
            f"{index}: no index of .bin files in its folder, as write_shards writes ({error})"
        ) from None
    paths = [folder / name for name in names]
    headers = [read_header(path) for path in paths]
    kinds, total = (
        {(h.vocab_size, h.tokenizer) for h in headers},
        sum(h.num_tokens for h in headers),
    )
    if kinds != {
        (entry.get("vocab_size"), entry.get("tokenizer"))
    } or total != entry.get("num_tokens"):
        raise ShardError(
            f"{index}: says {entry.get('num_tokens')!r} tokens of tokenizer {entry.get('tokenizer')!r} "
            f"({entry.get('vocab_size')!r} ids), but its shards hold {total:,} of {sorted(kinds)}"
        )
    return paths, headers


def cached_shards(
    folder: Path | str,
    make_tokens: Callable[[], np.ndarray],
    vocab_size: int,
    tokenizer: str,
    tokens_per_shard: int,
    prefix: str = "shard",
) -> list[Path]:
    """The shards in ``folder`` if they are complete and made by this tokenizer; otherwise rebuild them.

    A derived cache is trusted only after its index and every shard validate, never because one
    file exists: a run killed mid-write leaves a folder this rebuilds instead of failing on
    forever. A cache cut at another ``tokens_per_shard`` is rebuilt too (the cut decides which
    blocks exist). ``make_tokens()`` is called only to rebuild. The check and the rebuild hold a
    lock on the folder, so processes asking at once build it once (see the module docstring);
    shards are replaced, never deleted first, so their readers see old or new ones.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    # released by the system if this process dies
    with FileLock(folder / f".{prefix}.lock"):
        try:
            paths, headers = _read_index(folder, prefix)
            counts = [h.num_tokens for h in headers]
            if (
                (headers[0].vocab_size, headers[0].tokenizer) == (vocab_size, tokenizer)
                and set(counts[:-1]) <= {tokens_per_shard}
                and counts[-1] <= tokens_per_shard
            ):
                return paths
        except ShardError:
            pass
        paths = write_shards(
            make_tokens(), folder, vocab_size, tokenizer, tokens_per_shard, prefix
        )
        # Shards of an older, longer cut and leftovers of killed writes:
        for stale in {
            *folder.glob(f"{prefix}_*"),
            *folder.glob(f".{prefix}_*{TEMPORARY_MARKER}*"),
        } - {*paths, index_path(folder, prefix)}:
            stale.unlink(missing_ok=True)
        return paths


# ------------------------------------------------------------ 3. Streaming batches from shards
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
    """Yield ``(x, y)`` int64 batches of shape ``(batch_size, block_size)`` from token shards.

    ``y`` is ``x`` shifted by one token. Use with ``DataLoader(stream, batch_size=None,
    num_workers=...)``; every worker and every rank reads disjoint batches (see the module
    docstring). Shards are validated in the constructor and mapped lazily in each worker; a
    shard rewritten with another length in between is refused, not read past its end.
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
                f"TokenStream: {len(shards)} shards and {config}; expected at least one shard, positive "
                "block_size and batch_size, and 0 <= rank < world_size"
            )
        self.headers, names = (
            [read_header(p) for p in self.paths],
            ", ".join(map(str, self.paths)),
        )
        if len(kinds := {(h.tokenizer, h.vocab_size) for h in self.headers}) > 1:
            raise ShardError(
                f"{names}: ids of {len(kinds)} tokenizers {sorted(kinds)}; a stream reads one tokenizer's"
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
        # Tokens after each shard's last full block (a whole shard, if it is too short) are in no x or y.
        self.unused_tail_tokens = int(
            (
                counts - np.where(blocks_per_shard > 0, blocks_per_shard * block + 1, 0)
            ).sum()
        )
        per_step = config.world_size * config.batch_size
        self.batches_per_epoch = self.num_blocks // per_step  # on each rank
        if self.batches_per_epoch == 0:
            raise ShardError(
                f"{names}: {self.num_blocks:,} blocks of block_size={block} (each needs {block + 1} tokens"
                f" in a shard; the longest has {counts.max():,}), under one step of {per_step} blocks"
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
        """The position after the training loop has consumed ``batches_consumed`` batches in total.

        Count from the very start of training (not from the last resume). The configuration is
        saved too: a stream that would order batches differently refuses the position rather than skip data.
        """
        return {key: getattr(self.config, key) for key in _POSITION_KEYS} | {
            "num_blocks": self.num_blocks,
            "batches_consumed": batches_consumed,
        }

    def load_state_dict(self, state: dict) -> None:
        """Start the next iteration at the batch after the ``batches_consumed`` saved in ``state``."""
        expected = self.state_dict(0)
        if not isinstance(state, dict) or set(state) != set(expected):
            raise ValueError(
                f"stream state {state!r:.80} lacks or adds to the keys {sorted(expected)} of "
                "TokenStream.state_dict"
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
        """Batches one iteration yields on this rank, from the current start position."""
        if self.total_batches is None:
            raise TypeError(
                "TokenStream with epochs=None repeats forever and has no length"
            )
        return self.total_batches - self.start_batch

    # -- order
    def epoch_order(self, epoch: int) -> np.ndarray:
        """All block ids of ``epoch`` in the order they are read (before dealing to ranks).

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
        """Block ids of this rank's batches in ``epoch``, shape ``(batches_per_epoch, batch_size)``."""
        cfg = self.config
        used = self.batches_per_epoch * cfg.world_size * cfg.batch_size
        global_batches = self.epoch_order(epoch)[:used].reshape(-1, cfg.batch_size)
        # Within a batch, read blocks in file order (block ids run shard by shard): the rows' order
        # does not change the batch's gradient, and each shard's blocks become one contiguous slice.
        return np.sort(global_batches[cfg.rank :: cfg.world_size], axis=1)

    # -- reading
    def __getstate__(self) -> dict:
        # Pickled into DataLoader workers (spawn on macOS/Windows): send paths, never the mapped data.
        return {**self.__dict__, "_blocks": None}

    def _block_views(self) -> list[np.ndarray]:
        """Each shard's memmap viewed, read-only, as a table whose row ``i`` is the block at ``i * block_size``.

        Nothing is copied (consecutive rows share one token); a batch is a gather of whole rows.
        """
        block, views = self.config.block_size, []
        for path, header, rows in zip(
            self.paths, self.headers, self.blocks_per_shard, strict=True
        ):
            tokens = open_shard(path)
            if (len(tokens), tokens.dtype.name) != (header.num_tokens, header.dtype):
                raise ShardError(
                    f"{path}: holds {len(tokens):,} {tokens.dtype} tokens, but {header.num_tokens:,} "
                    f"{header.dtype} when this stream was built; it was rewritten: build a new stream"
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
        """Read blocks ``block_ids`` (sorted, as rank_batches gives them) as int64 ``(x, y)``, one gather per shard."""
        # mapped on first use, in each worker
        self._blocks = self._blocks or self._block_views()
        # non-decreasing: rank_batches sorts each batch
        shard_of = self.block_shard[block_ids]
        # the block's row in its shard's view
        row_of = self.block_start[block_ids] // self.config.block_size
        # the common case with large shards: one gather of whole rows
        if shard_of[0] == shard_of[-1]:
            rows = self._blocks[shard_of[0]][row_of]
        else:  # one gather per shard (np.take would first copy the whole overlapping view)
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
