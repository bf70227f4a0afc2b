"""Tokens per second: TokenStream, the list-based TokenDataset, nanoGPT's get_batch.

All three read the same uint16 shard in seeded-random order and produce int64
``(x, y)`` batches of 32 x 256 tokens. For scale, the machine's memory-copy
bandwidth is measured in the same run with ``np.copyto`` between two 256 MiB
buffers (the destination pre-touched) and converted to tokens at 16 bytes
each (8 for x, 8 for y): the rate of merely copying the batches' bytes
through main memory. It is a yardstick, not a hard limit, since one batch
(128 KiB of int64 at the default sizes) stays in the CPU's cache.

Run: ``.venv/bin/python bench/token_stream.py`` (``--help`` for sizes).
The headline compares the stream as the training loop uses it, through
``DataLoader(stream, batch_size=None)``, with the tutorial dataset through its
shuffling ``DataLoader``; the stream iterated directly is printed too. The
last line printed is ``speedup over the list-based TokenDataset: <x>``, and the
script exits with an error when that ratio is below ``MIN_SPEEDUP``: chapter 4
reports the ratio it measures, and this is where the ratio is required.

The list-based ``TokenDataset`` is the tutorial version: non-overlapping blocks
(item ``i`` starts at ``i * block_size``) sliced from a Python list.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader

from torchbook.book.download import cache_dir
from torchbook.data import StreamConfig, TokenDataset, TokenStream
from torchbook.shards import HEADER_BYTES, ShardError, open_shard, write_shard

OUTPUT_BYTES_PER_TOKEN = 16  # int64 x and int64 y
# the stream over the list-based TokenDataset, at the default sizes (README's target)
MIN_SPEEDUP = 50


def make_shard(folder: Path, num_tokens: int, vocab_size: int, seed: int) -> Path:
    """A shard of random token ids (reused if it already exists with the same size)."""
    path = folder / f"bench_{num_tokens}.bin"
    try:
        if len(open_shard(path)) == num_tokens:
            return path
    except ShardError:  # missing, truncated or not a shard: written anew below
        pass
    ids = np.random.default_rng(seed).integers(
        0, vocab_size, num_tokens, dtype=np.int64
    )
    return write_shard(
        path, ids, vocab_size=vocab_size, tokenizer=f"random ids, seed {seed}"
    )


def rate(batches, count: int) -> float:
    """Tokens per second of ``x`` over ``count`` batches, after one warm-up batch."""
    iterator = iter(batches)
    next(iterator)
    tokens = 0
    start = time.perf_counter()
    for _ in range(count):
        x, y = next(iterator)
        tokens += x.numel()
    return tokens / (time.perf_counter() - start)


def tutorial_batches(path: Path, block: int, batch: int, seed: int):
    """The tutorial version: Python list, map-style dataset, shuffling DataLoader."""
    tokens = open_shard(path).tolist()
    dataset = TokenDataset(tokens, block)
    return DataLoader(
        dataset,
        batch_size=batch,
        shuffle=True,
        generator=torch.Generator().manual_seed(seed),
    )


def get_batch_batches(path: Path, block: int, batch: int, seed: int):
    """nanoGPT-style get_batch: random offsets, one slice per row, stacked.

    The memmap is reopened for every batch, as nanoGPT does.
    """
    generator = torch.Generator().manual_seed(seed)
    while True:
        # the ids after the shard's header
        data = np.memmap(path, dtype=np.uint16, mode="r", offset=HEADER_BYTES)
        starts = torch.randint(len(data) - block, (batch,), generator=generator)
        x = torch.stack(
            [torch.from_numpy(data[i : i + block].astype(np.int64)) for i in starts]
        )
        y = torch.stack(
            [
                torch.from_numpy(data[i + 1 : i + 1 + block].astype(np.int64))
                for i in starts
            ]
        )
        yield x, y


def stream_batches(path: Path, block: int, batch: int, seed: int):
    """TokenStream through a DataLoader, as the training loop uses it.

    ``batch_size=None`` and no workers.
    """
    stream = TokenStream(
        [path],
        StreamConfig(
            block_size=block, batch_size=batch, shuffle=True, seed=seed, epochs=None
        ),
    )
    return DataLoader(stream, batch_size=None)


def copy_bandwidth(num_bytes: int, repeats: int) -> float:
    """Bytes per second of ``np.copyto`` from one ``num_bytes`` buffer to another.

    The destination is pre-touched.
    """
    source = np.random.default_rng(0).integers(0, 255, num_bytes, dtype=np.uint8)
    # every page touched, so no page faults are timed
    destination = np.ones_like(source)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(destination, source)
        times.append(time.perf_counter() - start)
    return num_bytes / min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tokens", type=int, default=16_000_000, help="tokens in the shard (uint16)"
    )
    parser.add_argument("--vocab-size", type=int, default=50_257)
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--stream-batches", type=int, default=3_000)
    parser.add_argument("--get-batch-batches", type=int, default=600)
    parser.add_argument("--tutorial-batches", type=int, default=150)
    parser.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="each method is timed this many times, interleaved; the best is kept",
    )
    parser.add_argument("--seed", type=int, default=1337)
    args = parser.parse_args()
    torch.set_num_threads(1)  # loaders run on one core; the others train

    path = make_shard(cache_dir() / "bench", args.tokens, args.vocab_size, args.seed)
    machine = platform.processor() or platform.machine()
    print(f"machine: {machine}, {os.cpu_count()} cpus, torch {torch.__version__}")
    megabytes = path.stat().st_size / 1e6
    print(f"shard: {path} ({args.tokens:,} uint16 tokens, {megabytes:.0f} MB)")
    print(
        f"batches of {args.batch_size} x {args.block_size} int64 tokens, "
        f"seeded-random order, best of {args.rounds} interleaved rounds (as timeit "
        "does: other load only ever slows a round down)"
    )

    block, batch, seed = args.block_size, args.batch_size, args.seed
    methods = {
        "list-based TokenDataset": (
            lambda: tutorial_batches(path, block, batch, seed),
            args.tutorial_batches,
        ),
        "nanoGPT get_batch": (
            lambda: get_batch_batches(path, block, batch, seed),
            args.get_batch_batches,
        ),
        "TokenStream": (
            lambda: stream_batches(path, block, batch, seed),
            args.stream_batches,
        ),
        "TokenStream, no DataLoader": (
            lambda: iter(stream_batches(path, block, batch, seed).dataset),
            args.stream_batches,
        ),
    }
    # the Python list is built once, untimed
    made = {name: make() for name, (make, _) in methods.items()}
    rates: dict[str, list[float]] = {name: [] for name in methods}
    bandwidths = []
    for _ in range(args.rounds):
        for name, (_, count) in methods.items():
            rates[name].append(rate(made[name], count))
        bandwidths.append(copy_bandwidth(256 << 20, repeats=3))

    bandwidth = max(bandwidths)
    copy_rate = bandwidth / OUTPUT_BYTES_PER_TOKEN
    print(
        f"memory copy (np.copyto, 256 MiB): {bandwidth / 1e9:.1f} GB/s -> "
        f"{copy_rate / 1e6:.0f} M tokens/s at {OUTPUT_BYTES_PER_TOKEN} bytes per token"
    )
    for name, values in rates.items():
        best = max(values)
        print(
            f"{name:>27}: {best / 1e6:8.2f} M tokens/s  "
            f"({best / copy_rate:6.1%} of the memory-copy rate)"
        )
    list_rate = max(rates["list-based TokenDataset"])
    stream_rate = max(rates["TokenStream"])
    get_batch_rate = max(rates["nanoGPT get_batch"])
    print(f"speedup over nanoGPT get_batch: {stream_rate / get_batch_rate:.1f}")
    speedup = stream_rate / list_rate
    print(f"speedup over the list-based TokenDataset: {speedup:.1f}")
    if speedup < MIN_SPEEDUP:
        raise SystemExit(
            f"the stream is only {speedup:.1f}x the list-based TokenDataset; "
            f"expected at least {MIN_SPEEDUP}x"
        )


if __name__ == "__main__":
    main()
