"""Cold and warm reads of token shards: what "mapping a file costs nothing" means.

Chapter 4 measures the token stream with its shards in the page cache (it has just
written them), so its rates are warm-cache rates. This bench measures the other
case, on Linux. It writes shards of random ids, evicts them from the page cache
(``os.posix_fadvise(..., POSIX_FADV_DONTNEED)``), and checks that the eviction
worked by asking the kernel which pages are resident (``mincore``, called through
``ctypes``, which reads none of them). Then it maps each shard with ``open_shard``,
checks residency again, and times a full read cold (from the disk) and again warm
(from the cache). How far apart the two are depends on the disk; a virtual disk
may itself be cached by its host.

Run: ``.venv/bin/python bench/page_cache.py`` (``--help`` for sizes).
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import sys
import time
from pathlib import Path

import numpy as np

from torchbook.book.download import cache_dir
from torchbook.shards import open_shard, write_shards


def resident_fraction(libc: ctypes.CDLL, path: Path) -> float:
    """Fraction of a file's pages in the page cache (Linux mincore); reads no page."""
    view = np.memmap(path, dtype=np.uint8, mode="r")
    pages = -(-view.size // mmap.PAGESIZE)
    flags = (ctypes.c_ubyte * pages)()
    address = ctypes.c_void_p(view.ctypes.data)
    if libc.mincore(address, ctypes.c_size_t(view.size), flags) != 0:
        raise OSError(ctypes.get_errno(), f"mincore failed on {path}")
    return sum(flag & 1 for flag in flags) / pages


def evict(path: Path) -> None:
    """Ask the kernel to drop a file's (clean) pages from the page cache."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(descriptor)


def read_seconds(paths: list[Path]) -> float:
    """Seconds to map every shard and sum its ids, which touches every page."""
    started = time.perf_counter()
    for path in paths:
        int(open_shard(path).sum())
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=20_000_000)
    parser.add_argument("--tokens-per-shard", type=int, default=5_000_000)
    parser.add_argument("--vocab-size", type=int, default=50_257)
    parser.add_argument("--seed", type=int, default=1337)
    args = parser.parse_args()
    if sys.platform != "linux":
        raise SystemExit("posix_fadvise and mincore are Linux interfaces")
    libc = ctypes.CDLL(None, use_errno=True)

    ids = np.random.default_rng(args.seed).integers(0, args.vocab_size, args.tokens)
    shards = write_shards(
        ids,
        cache_dir() / "bench" / "page-cache",
        vocab_size=args.vocab_size,
        tokenizer=f"random ids, seed {args.seed}",
        tokens_per_shard=args.tokens_per_shard,
    )
    megabytes = sum(path.stat().st_size for path in shards) / 1e6
    for path in shards:
        evict(path)
    evicted = np.mean([resident_fraction(libc, path) for path in shards])
    started = time.perf_counter()
    maps = [open_shard(path) for path in shards]
    open_s = time.perf_counter() - started
    after_open = np.mean([resident_fraction(libc, path) for path in shards])
    del maps  # a mapped page is never evicted; nothing is mapped from here on
    cold_s = read_seconds(shards)
    after_read = np.mean([resident_fraction(libc, path) for path in shards])
    warm_s = read_seconds(shards)
    print(f"{len(shards)} shards, {megabytes:.0f} MB, in {shards[0].parent}")
    print(
        f"resident after eviction {evicted:.0%}, after mapping {after_open:.0%}, "
        f"after one read {after_read:.0%}"
    )
    print(f"open_shard on {len(shards)} cold shards: {open_s * 1e3:.2f} ms")
    print(f"full read, cold: {cold_s * 1e3:8.1f} ms ({megabytes / cold_s:,.0f} MB/s)")
    print(f"full read, warm: {warm_s * 1e3:8.1f} ms ({megabytes / warm_s:,.0f} MB/s)")
    if evicted >= 0.05:
        print(
            f"eviction left {evicted:.0%} of the pages cached: the cold read was warm"
        )


if __name__ == "__main__":
    main()
