"""Token ids on disk: shards with a header, written atomically, checked before use.

``write_shard`` stores ids in one ``.bin`` file: a JSON header padded to
``HEADER_BYTES`` (dtype, token count, vocabulary size, tokenizer) followed by the ids,
uint16 when the vocabulary fits, else uint32; llm.c's shards have the same shape.
``open_shard`` checks the header against the file's size and maps the ids with
``np.memmap``, both from one open file. ``write_shards`` cuts a token array into shards
with an index; ``cached_shards`` trusts a folder only when its index and every shard
validate, and rebuilds it otherwise.

Concurrency: a shard is one file replaced by one atomic rename, so a process that opens
it while another rewrites it reads the old shard or the new one, whole.
``cached_shards`` holds a lock on its folder while it checks and rebuilds, so processes
that ask for the same cache at once (DDP ranks, two notebooks) build it once and all get
it. Writing one folder with ``write_shards`` from several processes, or asking
``cached_shards`` for different contents of one folder at once, is not supported: give
each its own folder.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
from filelock import FileLock  # installed with torch, which uses it too

from torchbook.files import TEMPORARY_MARKER, atomic_write, atomic_write_text

SHARD_FORMAT = "torchbook-token-shard"
SHARD_VERSION = 2  # version 1 kept the header in a .json file beside the .bin
# The JSON header, padded with spaces; the ids start here, aligned for any id dtype.
HEADER_BYTES = 1024
UINT16_VOCAB_LIMIT = 1 << 16  # ids 0..65535 fit in two bytes


class ShardError(ValueError):
    """A shard or its index is missing, inconsistent, or does not fit the request."""


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
    """The smallest unsigned dtype for the ids: uint16 up to 65,536 ids, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= UINT16_VOCAB_LIMIT else np.uint32)


def write_shard(
    path: Path | str,
    tokens: np.ndarray | Sequence[int],
    vocab_size: int,
    tokenizer: str,
) -> Path:
    """Write token ids to ``path`` (a ``.bin`` file) after a header; return the path.

    Every argument and id is checked before anything is written, and the file is written
    with ``atomic_write``: a crash leaves the old shard or the new one, never a part.
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
            f"{path}: expected a .bin path, non-empty 1-D integer ids, vocab_size an "
            f"int in 1..2**32 and a tokenizer's name; got {ids.shape} {ids.dtype}, "
            f"{vocab_size=!r:.20}, {tokenizer=!r:.16}"
        )
    dtype = token_dtype(vocab_size)
    if (bad := np.flatnonzero((ids < 0) | (ids >= vocab_size))).size:
        raise ShardError(
            f"{path}: token id {int(ids[bad[0]])} at position {bad[0]:,} is outside "
            f"the vocabulary [0, {vocab_size}); nothing was written"
        )
    header = json.dumps(
        asdict(ShardHeader(dtype.name, int(ids.size), vocab_size, tokenizer))
    ).encode("utf-8")
    if len(header) >= HEADER_BYTES:
        raise ShardError(
            f"{path}: a {len(header):,}-byte header does not fit in {HEADER_BYTES:,}; "
            "shorten tokenizer"
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
    """From one open file: parse ``path``'s header, check the file size, map the ids."""
    try:
        handle = open(path, "rb")
    except FileNotFoundError:
        raise ShardError(
            f"{path}: shard file is missing (expected a .bin written by write_shard)"
        ) from None
    with handle:
        # not UTF-8 or JSON, a field missing or unknown, a vocabulary out of range
        try:
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
                f"{path}: header {entry!r:.200} is not one write_shard writes: format "
                f"{SHARD_FORMAT!r} version {SHARD_VERSION}, dtype {stored} for this "
                "vocabulary, counts > 0"
            )
        expected = HEADER_BYTES + header.num_tokens * np.dtype(header.dtype).itemsize
        if (actual := os.fstat(handle.fileno()).st_size) != expected:
            # An interrupted write leaves a shorter file; a longer one was changed
            # after write_shard (wider ids, data appended).
            cause = (
                "; was the write interrupted?"
                if actual < expected
                else ", more than its header says; were the ids rewritten or appended?"
            )
            raise ShardError(
                f"{path}: header says {header.num_tokens:,} {header.dtype} tokens "
                f"({expected:,} bytes with the header) but the file has {actual:,} "
                f"bytes{cause}"
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

    Header and ids come from one open file, so a shard replaced meanwhile is never
    half-read. ``check_ids=True`` also reads the whole shard once to confirm every id is
    below the vocabulary size (write_shard already checked when it wrote).
    """
    header, tokens = _read_header(Path(path))
    if check_ids and (bad := np.flatnonzero(tokens >= header.vocab_size)).size:
        raise ShardError(
            f"{path}: token id {int(tokens[bad[0]])} at position {bad[0]:,} is outside "
            f"the vocabulary [0, {header.vocab_size}) that its header declares"
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
    """Split ``tokens`` into shards of ``tokens_per_shard`` ids; return their paths.

    Shards are named ``<prefix>_000.bin``, ``<prefix>_001.bin``, ... The index
    ``<prefix>_index.json`` (shard names, total tokens, tokenizer) is removed first and
    written last, so it exists only when every shard does.
    """
    ids, folder = np.asarray(tokens), Path(folder)
    if (
        type(tokens_per_shard) is not int
        or tokens_per_shard <= 0
        or ids.ndim != 1
        or ids.size == 0
    ):
        raise ShardError(
            f"{folder}: {tokens_per_shard=!r} and ids of shape {ids.shape}; expected "
            "an int > 0 and 1-D ids"
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
    """The shards in ``folder``'s index, once the index and every shard validate."""
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
            f"{index}: no index of .bin files in its folder, as write_shards writes "
            f"({error})"
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
            f"{index}: says {entry.get('num_tokens')!r} tokens of tokenizer "
            f"{entry.get('tokenizer')!r} ({entry.get('vocab_size')!r} ids), but its "
            f"shards hold {total:,} of {sorted(kinds)}"
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
    """The shards in ``folder`` if complete and from this tokenizer; else rebuild them.

    A derived cache is trusted only after its index and every shard validate, never
    because one file exists: a run killed mid-write leaves a folder this rebuilds
    instead of failing on forever. A cache cut at another ``tokens_per_shard`` is
    rebuilt too (the cut decides which blocks exist). ``make_tokens()`` is called only
    to rebuild. The check and the rebuild hold a lock on the folder, so processes asking
    at once build it once (see the module docstring); shards are replaced, never deleted
    first, so their readers see old or new ones.
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
