"""The token pipeline: token ids on disk as shards, streamed back as ``(x, y)`` batches.

1. ``TokenDataset``: the map-style dataset most tutorials write (item ``i`` is the block starting
   at ``i * block_size`` of a Python list). Correct and slow: every token passes through the
   Python interpreter on every read.
2. Shards: ``write_shard`` stores ids as a flat ``.bin`` (uint16 when the vocabulary fits, else
   uint32) with a JSON sidecar; ``open_shard`` validates the pair and maps the file with
   ``np.memmap``. ``cached_shards`` trusts a folder only when its index and every shard validate.
3. ``TokenStream``: an ``IterableDataset`` of whole batches. Each shard is viewed, without
   copying, as a table whose rows are its blocks, so a batch is one gather of rows per shard it
   touches. Use it with ``DataLoader(stream, batch_size=None)``.

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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, fields
from itertools import pairwise
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from torchbook.files import TEMPORARY_MARKER, atomic_write, atomic_write_text

SHARD_FORMAT = "torchbook-token-shard"
SHARD_VERSION = 1
UINT16_VOCAB_LIMIT = 1 << 16  # ids 0..65535 fit in two bytes
TOKEN_DTYPES = ("uint16", "uint32")


class ShardError(ValueError):
    """A shard or its sidecar is missing, inconsistent, or does not fit the request."""


# ------------------------------------------------------------ 1. The tutorial version
class TokenDataset(Dataset):
    """Map-style dataset over a Python list of token ids: item ``i`` is the block starting at ``i * block_size``.

    The version most tutorials write, kept to be measured: each item copies ``2 * block_size``
    Python ints into two new tensors, one by one. Its blocks are exactly ``TokenStream``'s over
    one shard in file order.
    """

    def __init__(self, tokens: Sequence[int], block_size: int) -> None:
        if block_size <= 0 or len(tokens) < block_size + 1:
            raise ShardError(f"TokenDataset: block_size={block_size} needs at least {block_size + 1} tokens, "
                             f"but the data has {len(tokens)}")
        self.tokens = tokens
        self.block_size = block_size

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start, end = i * self.block_size, (i + 1) * self.block_size
        return torch.tensor(self.tokens[start:end]), torch.tensor(self.tokens[start + 1 : end + 1])


# ------------------------------------------------------------ 2. Shards on disk
@dataclass(frozen=True)
class ShardHeader:
    """What the sidecar ``<shard>.json`` says about ``<shard>.bin``."""

    dtype: str  # "uint16" or "uint32"
    num_tokens: int
    vocab_size: int
    tokenizer: str  # file name or description of the tokenizer that produced the ids
    format: str = SHARD_FORMAT
    version: int = SHARD_VERSION


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every id of a vocabulary: uint16 up to 65,536 ids."""
    if type(vocab_size) is not int or not 0 < vocab_size <= 1 << 32:
        raise ShardError(f"vocab_size={vocab_size!r}: expected an int in 1..2**32, the number of token ids")
    return np.dtype(np.uint16 if vocab_size <= UINT16_VOCAB_LIMIT else np.uint32)


def sidecar_path(shard: Path | str) -> Path:
    """The JSON sidecar that describes a ``.bin`` shard."""
    return Path(shard).with_suffix(".json")


def write_shard(path: Path | str, tokens: np.ndarray | Sequence[int], vocab_size: int, tokenizer: str) -> Path:
    """Write token ids to ``path`` (a ``.bin`` file) and its sidecar; return the path.

    Every argument and id is checked before anything is written. The old sidecar is removed
    first, then the ``.bin`` and the new sidecar are each written with ``atomic_write``, the
    sidecar last: a crash leaves no sidecar or one that describes the ``.bin``, never a stale one.
    """
    path, ids = Path(path), np.asarray(tokens)
    for wrong, message in (
        (path.suffix != ".bin", "a shard's file name must end in .bin"),
        (ids.ndim != 1 or ids.size == 0, f"expected a non-empty 1-D sequence of token ids, got shape {ids.shape}"),
        (not np.issubdtype(ids.dtype, np.integer), f"token ids must be integers, got dtype {ids.dtype}"),
        (not isinstance(tokenizer, str), f"tokenizer={tokenizer!r}: expected a string naming the tokenizer"),
    ):
        if wrong:
            raise ShardError(f"{path}: {message}")
    try:
        dtype = token_dtype(vocab_size)
    except ShardError as error:
        raise ShardError(f"{path}: {error}; nothing was written") from None
    if ids.min() < 0 or ids.max() >= vocab_size:
        bad = int(np.flatnonzero((ids < 0) | (ids >= vocab_size))[0])
        raise ShardError(f"{path}: token id {int(ids[bad])} at position {bad:,} is outside the vocabulary "
                         f"[0, {vocab_size}); nothing was written")
    header = ShardHeader(dtype=dtype.name, num_tokens=int(ids.size), vocab_size=vocab_size, tokenizer=tokenizer)
    sidecar_path(path).unlink(missing_ok=True)
    atomic_write(path, lambda temporary: ids.astype(dtype).tofile(temporary))
    atomic_write_text(sidecar_path(path), json.dumps(asdict(header), indent=2) + "\n")
    return path


def index_path(folder: Path | str, prefix: str = "shard") -> Path:
    """The index ``write_shards`` writes last: ``<folder>/<prefix>_index.json``."""
    return Path(folder) / f"{prefix}_index.json"


def write_shards(tokens: np.ndarray | Sequence[int], folder: Path | str, vocab_size: int, tokenizer: str,
                 tokens_per_shard: int, prefix: str = "shard") -> list[Path]:
    """Split ``tokens`` into shards of ``tokens_per_shard`` ids named ``<prefix>_000.bin``, ...; return their paths.

    The index ``<prefix>_index.json`` (shard names, total tokens, tokenizer) is
    removed first and written last, so it exists only when every shard does.
    """
    ids, folder = np.asarray(tokens), Path(folder)
    if type(tokens_per_shard) is not int or tokens_per_shard <= 0 or ids.ndim != 1 or ids.size == 0:
        raise ShardError(f"{folder}: tokens_per_shard={tokens_per_shard!r} for {ids.shape} ids; expected a "
                         "positive int and a non-empty 1-D sequence of ids")
    index = index_path(folder, prefix)
    index.unlink(missing_ok=True)
    paths = [write_shard(folder / f"{prefix}_{number:03d}.bin", ids[start : start + tokens_per_shard], vocab_size,
                         tokenizer) for number, start in enumerate(range(0, len(ids), tokens_per_shard))]
    entry = {"shards": [p.name for p in paths], "num_tokens": int(ids.size), "vocab_size": vocab_size,
             "tokenizer": tokenizer}
    atomic_write_text(index, json.dumps(entry, indent=2) + "\n")
    return paths


def read_shards(folder: Path | str, prefix: str = "shard") -> list[Path]:
    """The shards listed by ``folder``'s index, after validating the index and every shard against it."""
    index = index_path(folder, prefix)
    entry = _read_fields(index, "a shard index written by write_shards",
                         {"num_tokens": int, "vocab_size": int, "tokenizer": str})
    names = entry.get("shards")
    if not isinstance(names, list) or not names or not all(
            isinstance(name, str) and Path(name).name == name and name.endswith(".bin") for name in names):
        raise ShardError(f"{index}: field 'shards' is {names!r:.80}; expected a non-empty list of .bin file "
                         "names in the index's folder")
    paths = [Path(folder) / name for name in names]
    headers = [read_header(p) for p in paths]
    total = sum(h.num_tokens for h in headers)
    if total != entry["num_tokens"]:
        raise ShardError(f"{index}: field 'num_tokens' says {entry['num_tokens']!r} but its shards hold {total:,}")
    for path, header in zip(paths, headers):
        if (header.vocab_size, header.tokenizer) != (entry["vocab_size"], entry["tokenizer"]):
            raise ShardError(f"{path}: tokenizer {header.tokenizer!r} / {header.vocab_size} ids disagrees with {index}")
    return paths


def cached_shards(folder: Path | str, make_tokens: Callable[[], np.ndarray], vocab_size: int, tokenizer: str,
                  tokens_per_shard: int, prefix: str = "shard") -> list[Path]:
    """The shards in ``folder`` if they are complete and made by this tokenizer; otherwise rebuild them.

    A derived cache is trusted only after ``read_shards`` has validated the index and every
    shard, never because one file exists: a run killed mid-write leaves a folder this rebuilds
    instead of failing on forever. A cache cut at another ``tokens_per_shard`` is rebuilt too (the
    cut decides which blocks exist). ``make_tokens()`` is called only to rebuild, after every
    ``<prefix>_*`` file in ``folder`` is deleted.
    """
    try:
        paths = read_shards(folder, prefix)
        headers = [read_header(path) for path in paths]
        counts = [h.num_tokens for h in headers]
        if all((h.vocab_size, h.tokenizer) == (vocab_size, tokenizer) for h in headers) \
                and set(counts[:-1]) <= {tokens_per_shard} and counts[-1] <= tokens_per_shard:
            return paths
    except ShardError:
        pass
    for stale in [*Path(folder).glob(f"{prefix}_*"), *Path(folder).glob(f".{prefix}_*{TEMPORARY_MARKER}*")]:
        stale.unlink()
    return write_shards(make_tokens(), folder, vocab_size, tokenizer, tokens_per_shard, prefix)


def _read_fields(path: Path, expected: str, types: dict[str, type]) -> dict:
    """Parse a JSON object whose fields must have ``types`` (a bool is not an int); every error names ``path``."""
    if not path.is_file():
        raise ShardError(f"{path}: missing; expected {expected}")
    try:
        entry = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as error:
        raise ShardError(f"{path}: not UTF-8 text ({error}); expected {expected}") from error
    except json.JSONDecodeError as error:
        raise ShardError(f"{path}: not JSON ({error}); expected {expected}") from error
    if not isinstance(entry, dict):
        raise ShardError(f"{path}: holds a JSON {type(entry).__name__}; expected an object, {expected}")
    for name, kind in types.items():
        value = entry.get(name)
        if name not in entry or not isinstance(value, kind) or isinstance(value, bool):
            found = "missing" if name not in entry else f"{value!r} ({type(value).__name__})"
            raise ShardError(f"{path}: field {name!r} is {found}; expected {kind.__name__}")
    return entry


# The sidecar's fields and the Python type each must have.
_HEADER_TYPES = {field.name: {"str": str, "int": int}[field.type] for field in fields(ShardHeader)}


def read_header(path: Path | str) -> ShardHeader:
    """Read and validate the sidecar of shard ``path`` against the shard's size on disk."""
    path = Path(path)
    meta = sidecar_path(path)
    if not path.is_file():
        raise ShardError(f"{path}: shard file is missing (expected a .bin written by write_shard)")
    if not meta.is_file():
        raise ShardError(f"{meta}: sidecar is missing; without it {path.name} has no known dtype or length")
    entry = _read_fields(meta, "a shard sidecar written by write_shard", _HEADER_TYPES)
    unknown = sorted(set(entry) - set(_HEADER_TYPES))
    if unknown:
        raise ShardError(f"{meta}: unknown field(s) {unknown}; expected only {sorted(_HEADER_TYPES)}")
    header = ShardHeader(**entry)
    for wrong, message in (
        ((header.format, header.version) != (SHARD_FORMAT, SHARD_VERSION),
         f"format {header.format!r} version {header.version}, expected {SHARD_FORMAT!r} version {SHARD_VERSION}"),
        (header.num_tokens <= 0, f"field 'num_tokens' is {header.num_tokens}; a shard holds at least one token"),
        (header.vocab_size <= 0, f"field 'vocab_size' is {header.vocab_size}; expected a positive number of ids"),
        (header.dtype not in TOKEN_DTYPES, f"dtype {header.dtype!r}, expected one of {TOKEN_DTYPES}"),
    ):
        if wrong:
            raise ShardError(f"{meta}: {message}")
    stored = token_dtype(header.vocab_size).name
    if header.dtype != stored:
        raise ShardError(f"{meta}: dtype {header.dtype} disagrees with vocab_size {header.vocab_size:,}, "
                         f"which write_shard stores as {stored}")
    expected_bytes, actual_bytes = header.num_tokens * np.dtype(header.dtype).itemsize, path.stat().st_size
    if actual_bytes != expected_bytes:
        other = "uint32" if header.dtype == "uint16" else "uint16"
        hint = (f"; that is exactly {header.num_tokens:,} {other} tokens, was it written with another dtype?"
                if actual_bytes == header.num_tokens * np.dtype(other).itemsize else "; was the write interrupted?")
        raise ShardError(f"{path}: header says {header.num_tokens:,} {header.dtype} tokens ({expected_bytes:,} bytes) "
                         f"but the file has {actual_bytes:,} bytes{hint}")
    return header


def open_shard(path: Path | str, check_ids: bool = False) -> np.memmap:
    """Validate shard ``path`` and map it read-only as a 1-D array of token ids.

    ``check_ids=True`` also reads the whole shard once to confirm every id is below the
    vocabulary size (write_shard already checked when it wrote).
    """
    header = read_header(path)
    tokens = np.memmap(path, dtype=header.dtype, mode="r", shape=(header.num_tokens,))
    if check_ids and tokens.max() >= header.vocab_size:
        position = int(np.argmax(tokens >= header.vocab_size))
        raise ShardError(f"{path}: token id {int(tokens.max())} (first bad one at position {position:,}) is outside "
                         f"the vocabulary [0, {header.vocab_size}) that its sidecar declares")
    return tokens


# ------------------------------------------------------------ 3. Streaming batches from shards
@dataclass(frozen=True)
class StreamConfig:
    """How ``TokenStream`` cuts, orders and divides the blocks."""

    block_size: int = 256
    batch_size: int = 32
    shuffle: bool = True  # seeded random order of blocks, new each epoch; False: file order
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
    docstring). Shards are validated in the constructor and mapped lazily in each worker.
    """

    def __init__(self, shards: Sequence[Path | str], config: StreamConfig) -> None:
        for wrong, message in ((not shards, "TokenStream: no shards given"),
                               (config.block_size <= 0 or config.batch_size <= 0,
                                f"{config}: block_size and batch_size must be positive"),
                               (not 0 <= config.rank < config.world_size, f"{config}: expected 0 <= rank < world_size")):
            if wrong:
                raise ShardError(message)
        self.paths, self.config = [Path(p) for p in shards], config
        headers = [read_header(p) for p in self.paths]
        for path, header in zip(self.paths[1:], headers[1:]):
            if (header.vocab_size, header.tokenizer) != (headers[0].vocab_size, headers[0].tokenizer):
                raise ShardError(f"{path}: ids from tokenizer {header.tokenizer!r} with {header.vocab_size:,} ids, but "
                                 f"{self.paths[0].name} has {headers[0].tokenizer!r} with {headers[0].vocab_size:,}; "
                                 f"one stream must hold ids of one tokenizer")
        counts = np.array([h.num_tokens for h in headers], dtype=np.int64)
        block, names = config.block_size, ", ".join(map(str, self.paths))
        # A block needs block_size + 1 tokens; consecutive blocks share one token.
        blocks_per_shard = self.blocks_per_shard = np.maximum((counts - 1) // block, 0)
        self.num_blocks = int(blocks_per_shard.sum())
        if self.num_blocks == 0:
            raise ShardError(f"{names}: block_size={block} needs at least {block + 1} tokens "
                             f"in one shard, but the longest has {int(counts.max()):,}")
        self.block_shard = np.repeat(np.arange(len(self.paths), dtype=np.int32), blocks_per_shard)
        self.block_start = np.concatenate([np.arange(n, dtype=np.int64) * block for n in blocks_per_shard])
        # Tokens after each shard's last full block (a whole shard, if it is too short) are in no x or y.
        used_tokens = np.where(blocks_per_shard > 0, blocks_per_shard * block + 1, 0)
        self.unused_tail_tokens = int((counts - used_tokens).sum())
        per_step = config.world_size * config.batch_size
        self.batches_per_epoch = self.num_blocks // per_step  # on each rank
        if self.batches_per_epoch == 0:
            raise ShardError(f"{names}: {self.num_blocks:,} blocks of {block} tokens are fewer than one step "
                             f"of {config.world_size} rank(s) x {config.batch_size} blocks")
        self.dropped_blocks_per_epoch = self.num_blocks - self.batches_per_epoch * per_step
        self.start_batch = 0  # position to resume from, in batches this rank has consumed
        self._blocks: list[np.ndarray] | None = None  # each shard viewed as blocks, made lazily once per process

    # -- positions
    def state_dict(self, batches_consumed: int) -> dict:
        """The position after the training loop has consumed ``batches_consumed`` batches in total.

        Count from the very start of training (not from the last resume). The configuration is
        saved too: a stream that would order batches differently refuses the position rather than skip data.
        """
        if batches_consumed < 0:
            raise ValueError(f"batches_consumed={batches_consumed}: expected a count >= 0")
        return self._layout() | {"batches_consumed": int(batches_consumed)}

    def _layout(self) -> dict:
        return {key: getattr(self.config, key) for key in _POSITION_KEYS} | {"num_blocks": self.num_blocks}

    def load_state_dict(self, state: dict) -> None:
        """Start the next iteration at the batch after the ``batches_consumed`` saved in ``state``."""
        expected = self._layout()
        missing = sorted({*expected, "batches_consumed"} - set(state)) if isinstance(state, dict) else ["everything"]
        if missing:
            raise ValueError(f"stream state lacks {missing}; expected a dict from TokenStream.state_dict")
        differs = {key: (state[key], value) for key, value in expected.items() if state[key] != value}
        if differs:
            detail = ", ".join(f"{key} saved {saved!r} but this stream has {now!r}" for key, (saved, now) in differs.items())
            raise ValueError(f"cannot resume this stream: {detail}")
        position, total = state["batches_consumed"], self._total_batches()
        if type(position) is not int or position < 0 or (total is not None and position > total):
            raise ValueError(f"batches_consumed={position!r}: expected an int in 0..{total} for this stream")
        self.start_batch = position

    def _total_batches(self) -> int | None:
        return None if self.config.epochs is None else self.config.epochs * self.batches_per_epoch

    def __len__(self) -> int:
        """Batches one iteration yields on this rank, from the current start position."""
        total = self._total_batches()
        if total is None:
            raise TypeError("TokenStream with epochs=None repeats forever and has no length")
        return total - self.start_batch

    # -- order
    def epoch_order(self, epoch: int) -> np.ndarray:
        """All block ids of ``epoch`` in the order they are read (before dealing to ranks).

        Seeded by the pair ``(seed, epoch)``, so seed 1 epoch 0 and seed 0
        epoch 1 are different orders (``seed + epoch`` would make them equal).
        """
        if not self.config.shuffle:
            return np.arange(self.num_blocks)
        return np.random.default_rng((self.config.seed, epoch)).permutation(self.num_blocks)

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
        """Each shard's memmap viewed, read-only, as a table whose row ``i`` is the block starting at ``i * block_size``.

        Nothing is copied (consecutive rows share one token); a batch is a gather of whole rows.
        """
        block = self.config.block_size
        views = []
        for path, rows in zip(self.paths, self.blocks_per_shard):
            tokens = open_shard(path)
            views.append(np.lib.stride_tricks.as_strided(tokens, shape=(int(rows), block + 1), writeable=False,
                                                         strides=(block * tokens.itemsize, tokens.itemsize)))
        return views

    def _gather(self, block_ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Read blocks ``block_ids`` (sorted, as rank_batches gives them) as int64 ``(x, y)``, one row copy per shard."""
        if self._blocks is None:
            self._blocks = self._block_views()
        shard_of = self.block_shard[block_ids]  # non-decreasing: rank_batches sorts each batch
        row_of = self.block_start[block_ids] // self.config.block_size  # the block's row in its shard's view
        if shard_of[0] == shard_of[-1]:
            rows = self._blocks[shard_of[0]][row_of]  # the common case with large shards: one gather
        else:
            rows = np.empty((len(block_ids), self.config.block_size + 1), dtype=self._blocks[0].dtype)
            cuts = [0, *(np.flatnonzero(np.diff(shard_of)) + 1), len(block_ids)]  # where the shard changes
            for first, end in pairwise(cuts):
                rows[first:end] = self._blocks[shard_of[first]][row_of[first:end]]
        # astype copies, so x and y come out contiguous (y.view(-1) works) and writable.
        return torch.from_numpy(rows[:, :-1].astype(np.int64)), torch.from_numpy(rows[:, 1:].astype(np.int64))

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        worker = get_worker_info()
        num_workers, worker_id = (1, 0) if worker is None else (worker.num_workers, worker.id)
        total = self._total_batches()
        position = self.start_batch + worker_id  # this worker's first batch
        epoch, batches = None, None
        while total is None or position < total:
            if position // self.batches_per_epoch != epoch:
                epoch = position // self.batches_per_epoch
                batches = self.rank_batches(epoch)
            yield self._gather(batches[position % self.batches_per_epoch])
            position += num_workers
