"""Tests for the token pipeline: shards, their errors, and the streaming dataset."""

from __future__ import annotations

import json
import multiprocessing
import pickle
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import torchbook.data as data
import torchbook.files as files
from torchbook.data import StreamConfig, TokenDataset, TokenStream
from torchbook.shards import (
    HEADER_BYTES,
    ShardError,
    cached_shards,
    index_path,
    open_shard,
    read_header,
    read_shards,
    write_shard,
    write_shards,
)


def counting_shards(folder, num_tokens=2_000, tokens_per_shard=700):
    """Shards holding 0, 1, 2, ...: a block's first token says where it came from."""
    return write_shards(
        np.arange(num_tokens),
        folder,
        vocab_size=num_tokens,
        tokenizer="counting",
        tokens_per_shard=tokens_per_shard,
    )


def read_all(stream, worker=None, monkeypatch=None):
    """Every batch one (simulated) worker yields, as a list of (x, y)."""
    if worker is not None:
        monkeypatch.setattr(data, "get_worker_info", lambda: worker)
    return list(stream)


# -- the tutorial TokenDataset ---------------------------------------------------


def test_tutorial_dataset_items_are_non_overlapping_blocks_and_their_shift():
    tokens = list(range(100, 150))  # 50 tokens: (50 - 1) // 8 = 6 blocks
    dataset = TokenDataset(tokens, block_size=8)
    assert len(dataset) == 6
    x, y = dataset[5]
    assert x.tolist() == tokens[40:48]
    assert y.tolist() == tokens[41:49]


def test_tutorial_dataset_blocks_are_the_streams_blocks_in_file_order(tmp_path):
    tokens = np.random.default_rng(1).integers(0, 500, 1_000)
    shard = write_shard(tmp_path / "s.bin", tokens, vocab_size=500, tokenizer="t")
    stream = TokenStream(
        [shard], StreamConfig(block_size=16, batch_size=1, shuffle=False)
    )
    dataset = TokenDataset(tokens.tolist(), block_size=16)
    assert len(dataset) == stream.num_blocks
    for (x, y), (sx, sy) in zip(
        (dataset[i] for i in range(len(dataset))), stream, strict=True
    ):
        assert torch.equal(x, sx[0]) and torch.equal(y, sy[0])


def test_tutorial_dataset_refuses_block_longer_than_data():
    with pytest.raises(ShardError, match="block_size=10 needs 11 tokens; got 10"):
        TokenDataset(list(range(10)), block_size=10)


# -- shards -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "vocab_size, dtype", [(256, np.uint16), (65_536, np.uint16), (65_537, np.uint32)]
)
def test_writer_picks_the_smallest_dtype_for_the_vocabulary(
    tmp_path, vocab_size, dtype
):
    tokens = np.array([0, 1, vocab_size - 1])
    path = write_shard(tmp_path / "s.bin", tokens, vocab_size=vocab_size, tokenizer="t")
    assert path.stat().st_size == HEADER_BYTES + tokens.size * np.dtype(dtype).itemsize
    assert read_header(path).dtype == np.dtype(dtype).name


def test_shard_reads_back_the_ids_written_after_a_readable_header(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 50_000, 1_234)
    path = write_shard(tmp_path / "s.bin", tokens, vocab_size=50_000, tokenizer="t")
    mapped = open_shard(path, check_ids=True)
    assert isinstance(mapped, np.memmap)
    np.testing.assert_array_equal(mapped, tokens)
    # plain JSON, padded with spaces
    header = json.loads(path.read_bytes()[:HEADER_BYTES])
    assert (header["num_tokens"], header["vocab_size"], header["tokenizer"]) == (
        1_234,
        50_000,
        "t",
    )
    np.testing.assert_array_equal(
        np.fromfile(path, dtype=np.uint16, offset=HEADER_BYTES), tokens
    )


def test_write_shards_splits_without_losing_a_token(tmp_path):
    paths = counting_shards(tmp_path, num_tokens=2_000, tokens_per_shard=700)
    assert [p.name for p in paths] == [
        "shard_000.bin",
        "shard_001.bin",
        "shard_002.bin",
    ]
    np.testing.assert_array_equal(
        np.concatenate([open_shard(p) for p in paths]), np.arange(2_000)
    )


def test_missing_shard_is_an_error_naming_it(tmp_path):
    with pytest.raises(ShardError, match=r"nope\.bin: shard file is missing"):
        read_header(tmp_path / "nope.bin")


def test_raw_ids_without_a_header_are_refused_naming_the_file(tmp_path):
    path = tmp_path / "raw.bin"
    # what version 1 wrote beside a .json sidecar
    np.arange(2_000, dtype=np.uint16).tofile(path)
    with pytest.raises(
        ShardError, match=r"raw\.bin: no shard header in its first 1,024 bytes"
    ):
        open_shard(path)


def test_truncated_shard_disagrees_with_its_header(tmp_path):
    path = write_shard(
        tmp_path / "s.bin", np.arange(100), vocab_size=100, tokenizer="t"
    )
    with open(path, "r+b") as handle:
        handle.truncate(HEADER_BYTES + 150)
    with pytest.raises(
        ShardError,
        match=r"s\.bin: header says 100 uint16 tokens \(1,224 bytes with the header\) "
        r"but the file has 1,174 bytes; was the write interrupted\?",
    ):
        open_shard(path)


def test_ids_rewritten_wider_behind_the_header_are_caught_by_the_file_size(tmp_path):
    path = write_shard(
        tmp_path / "s.bin", np.arange(100), vocab_size=100, tokenizer="t"
    )
    # the same ids rewritten four bytes wide after the header
    with open(path, "r+b") as handle:
        handle.seek(HEADER_BYTES)
        np.arange(100, dtype=np.uint32).tofile(handle)
    with pytest.raises(ShardError) as refusal:
        open_shard(path)
    # longer than the header says: not an interrupted write, which leaves it shorter
    message = str(refusal.value)
    assert "header says 100 uint16 tokens" in message
    assert "the file has 1,424 bytes, more than its header says" in message
    assert "interrupted" not in message


def header_with(path, **changes):
    """Rewrite ``path``'s header in place with some fields changed; the ids stay put."""
    raw = path.read_bytes()
    header = json.dumps({**json.loads(raw[:HEADER_BYTES]), **changes}).encode()
    path.write_bytes(header.ljust(HEADER_BYTES) + raw[HEADER_BYTES:])
    return path


def test_header_dtype_that_disagrees_with_its_vocabulary_is_refused(tmp_path):
    path = header_with(
        write_shard(tmp_path / "s.bin", np.arange(100), vocab_size=100, tokenizer="t"),
        vocab_size=100_000,
    )
    with pytest.raises(
        ShardError,
        match=r"s\.bin: header .* is not one write_shard writes.*dtype uint32 for this",
    ):
        open_shard(path)


def test_token_id_beyond_the_vocabulary_is_refused_before_writing(tmp_path):
    with pytest.raises(
        ShardError,
        match=r"s\.bin: token id 10 at position 2 is outside the vocabulary \[0, 10\)",
    ):
        write_shard(tmp_path / "s.bin", [3, 4, 10, 5], vocab_size=10, tokenizer="t")
    assert list(tmp_path.iterdir()) == []


def test_token_id_beyond_the_vocabulary_is_found_when_checking_on_read(tmp_path):
    path = write_shard(tmp_path / "s.bin", [3, 4, 5, 6], vocab_size=10, tokenizer="t")
    with open(path, "r+b") as handle:  # corrupted after writing
        handle.seek(HEADER_BYTES)
        np.array([3, 4, 12, 6], dtype=np.uint16).tofile(handle)
    open_shard(path)  # only sizes are checked by default
    with pytest.raises(
        ShardError,
        match=r"s\.bin: token id 12 at position 2 is outside the vocabulary \[0, 10\)",
    ):
        open_shard(path, check_ids=True)


def test_block_longer_than_every_shard_is_an_error_naming_them(tmp_path):
    paths = counting_shards(tmp_path, num_tokens=200, tokens_per_shard=100)
    with pytest.raises(
        ShardError,
        match=r"shard_000\.bin.*block_size=100 \(each needs 101 tokens in a shard; "
        r"the longest has 100\)",
    ):
        TokenStream(paths, StreamConfig(block_size=100, batch_size=1))


def test_shards_of_another_tokenizer_are_refused_naming_both(tmp_path):
    first = write_shard(
        tmp_path / "a.bin", np.arange(100), vocab_size=100, tokenizer="bpe-100"
    )
    other = write_shard(
        tmp_path / "b.bin", np.arange(100), vocab_size=256, tokenizer="bytes"
    )
    with pytest.raises(
        ShardError,
        match=r"a\.bin, .*b\.bin: ids of 2 tokenizers "
        r"\[\('bpe-100', 100\), \('bytes', 256\)\]",
    ):
        TokenStream([first, other], StreamConfig(block_size=8, batch_size=1))


@pytest.mark.parametrize(
    "field, value",
    [
        ("num_tokens", "100"),
        ("num_tokens", 100.0),
        ("vocab_size", None),
        ("vocab_size", True),
        ("tokenizer", 7),
        ("dtype", ["uint16"]),
        ("num_tokens", 0),
        ("version", 1),
        ("format", "npy"),
    ],
)
def test_header_field_of_the_wrong_type_or_value_is_refused_naming_the_file(
    tmp_path, field, value
):
    path = header_with(
        write_shard(tmp_path / "s.bin", np.arange(100), vocab_size=100, tokenizer="t"),
        **{field: value},
    )
    with pytest.raises(
        ShardError,
        match=r"s\.bin: (header .* is not one write_shard writes|no shard header)",
    ):
        open_shard(path)


@pytest.mark.parametrize(
    "content",
    [
        b'{"tokenizer": "\xff\xfe"}',
        b"{not json",
        b"[1, 2]",
        b"null",
        b'{"dtype": "uint16", "num_tokens": 1, "vocab_size": 10, "tokenizer": "t"}',
        b'{"dtype": "uint16", "num_tokens": 1, "vocab_size": 10, "tokenizer": "t", '
        b'"format": "torchbook-token-shard", "version": 2, "extra": 1}',
    ],
)
def test_a_header_that_is_not_a_shard_header_is_refused_naming_the_file(
    tmp_path, content
):
    path = tmp_path / "s.bin"
    path.write_bytes(content.ljust(HEADER_BYTES) + b"\x00\x00")
    with pytest.raises(
        ShardError,
        match=r"s\.bin: (no shard header in its first 1,024 bytes"
        r"|header .* is not one)",
    ):
        open_shard(path)


def test_empty_token_list_is_refused_before_writing(tmp_path):
    with pytest.raises(
        ShardError, match=r"s\.bin: expected a \.bin path, non-empty 1-D integer ids"
    ):
        write_shard(tmp_path / "s.bin", [], vocab_size=10, tokenizer="t")
    assert list(tmp_path.iterdir()) == []


def test_a_tokenizer_name_too_long_for_the_header_is_refused_before_writing(tmp_path):
    with pytest.raises(
        ShardError, match=r"s\.bin: a 1,1\d\d-byte header does not fit in 1,024"
    ):
        write_shard(tmp_path / "s.bin", [1, 2, 3], vocab_size=10, tokenizer="t" * 1_000)
    assert list(tmp_path.iterdir()) == []


def test_write_shard_fsyncs_a_unique_temporary_and_the_folder(tmp_path, monkeypatch):
    synced = []
    real_fsync = files.fsync_path
    monkeypatch.setattr(
        files, "fsync_path", lambda p: (synced.append(str(p)), real_fsync(p))
    )
    path = write_shard(
        tmp_path / "s.bin", np.arange(100), vocab_size=100, tokenizer="t"
    )
    temporaries = [p for p in synced if files.is_temporary(p)]
    # one temporary, fsynced before its rename, then the folder after the rename
    assert [p.split(".tmp-")[0] for p in temporaries] == [str(tmp_path / ".s.bin")]
    assert synced.count(str(tmp_path)) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.bin"]
    np.testing.assert_array_equal(open_shard(path), np.arange(100))


def test_a_crash_while_rewriting_leaves_the_old_shard_whole(tmp_path, monkeypatch):
    path = write_shard(
        tmp_path / "s.bin", np.arange(100), vocab_size=100, tokenizer="old"
    )

    def die(*args):
        raise KeyboardInterrupt("killed after writing the temporary, before its rename")

    monkeypatch.setattr(files, "fsync_path", die)
    with pytest.raises(KeyboardInterrupt):
        write_shard(path, np.arange(50)[::-1], vocab_size=100, tokenizer="new")
    assert read_header(path).tokenizer == "old"
    np.testing.assert_array_equal(open_shard(path), np.arange(100))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.bin"]


def test_index_exists_only_when_every_shard_was_written(tmp_path):
    paths = counting_shards(tmp_path)
    assert read_shards(tmp_path) == paths
    paths[1].unlink()
    with pytest.raises(ShardError, match=r"shard_001\.bin: shard file is missing"):
        read_shards(tmp_path)
    index_path(tmp_path).unlink()
    with pytest.raises(
        ShardError, match=r"shard_index\.json: no index of \.bin files .*No such file"
    ):
        read_shards(tmp_path)


def test_cached_shards_are_reused_when_complete(tmp_path):
    first = cached_shards(
        tmp_path,
        lambda: np.arange(2_000),
        vocab_size=2_000,
        tokenizer="c",
        tokens_per_shard=700,
    )

    def must_not_rebuild():
        raise AssertionError("a complete cache was rebuilt")

    assert (
        cached_shards(
            tmp_path,
            must_not_rebuild,
            vocab_size=2_000,
            tokenizer="c",
            tokens_per_shard=700,
        )
        == first
    )


@pytest.mark.parametrize("damage", ["shard", "index", "truncate"])
def test_cached_shards_rebuild_an_incomplete_cache(tmp_path, damage):
    paths = cached_shards(
        tmp_path,
        lambda: np.arange(2_000),
        vocab_size=2_000,
        tokenizer="c",
        tokens_per_shard=700,
    )
    if damage == "shard":  # deleted by hand
        paths[2].unlink()
    elif damage == "index":  # killed before the index
        index_path(tmp_path).unlink()
    else:
        with open(paths[0], "r+b") as handle:
            handle.truncate(HEADER_BYTES + 10)
    rebuilt = cached_shards(
        tmp_path,
        lambda: np.arange(2_000),
        vocab_size=2_000,
        tokenizer="c",
        tokens_per_shard=700,
    )
    np.testing.assert_array_equal(
        np.concatenate([open_shard(p) for p in rebuilt]), np.arange(2_000)
    )


def cache_files(paths):
    """What a cache folder should hold: its shards, its index and its lock file."""
    return sorted([p.name for p in paths] + ["shard_index.json", ".shard.lock"])


def test_cached_shards_of_another_tokenizer_are_rebuilt(tmp_path):
    cached_shards(
        tmp_path,
        lambda: np.arange(2_000),
        vocab_size=2_000,
        tokenizer="old",
        tokens_per_shard=700,
    )
    rebuilt = cached_shards(
        tmp_path,
        lambda: np.arange(900),
        vocab_size=1_000,
        tokenizer="new",
        tokens_per_shard=700,
    )
    assert [read_header(p).tokenizer for p in rebuilt] == ["new", "new"]
    assert sorted(p.name for p in tmp_path.iterdir()) == cache_files(rebuilt)


# -- several processes at once ----------------------------------------------------
ROUNDS = 6  # rounds of two processes asking for one cache at once: 12 calls


def slow_tokens() -> np.ndarray:
    time.sleep(0.05)  # as tokenizing takes time, so that the two processes overlap
    return np.arange(2_000)


def ask_for_the_cache_and_read_it(folder: str, barrier, results) -> None:
    """One process: ask for each round's cache when the other does, then read it."""
    for round_number in range(ROUNDS):
        barrier.wait()
        try:
            paths = cached_shards(
                Path(folder) / f"round_{round_number}",
                slow_tokens,
                vocab_size=2_000,
                tokenizer="c",
                tokens_per_shard=700,
            )
            same = np.array_equal(
                np.concatenate([open_shard(p) for p in paths]), np.arange(2_000)
            )
            results.put("ok" if same else "wrong ids")
        except Exception as error:  # reported to the test, which names it
            results.put(f"{type(error).__name__}: {error}")


@pytest.mark.slow
def test_two_processes_asking_for_one_cache_at_once_both_get_it(tmp_path):
    # a cache of another tokenizer in each folder: both must rebuild it
    for round_number in range(ROUNDS):
        write_shards(
            np.arange(3_000),
            tmp_path / f"round_{round_number}",
            vocab_size=3_000,
            tokenizer="old",
            tokens_per_shard=500,
        )
    # what macOS and Windows use; no state shared by fork
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(2), context.Queue()
    workers = [
        context.Process(
            target=ask_for_the_cache_and_read_it, args=(str(tmp_path), barrier, results)
        )
        for _ in range(2)
    ]
    for worker in workers:
        worker.start()
    outcomes = [results.get(timeout=120) for _ in range(2 * ROUNDS)]
    for worker in workers:
        worker.join(timeout=30)
    assert outcomes == ["ok"] * (2 * ROUNDS), outcomes


REWRITER = """
import sys, numpy as np
from torchbook.shards import write_shard
path, rounds = sys.argv[1], int(sys.argv[2])
print("started", flush=True)
for number in range(rounds):  # two contents of different lengths, in turn
    ids = np.arange(1_000 + 1_000 * (number % 2))
    write_shard(path, ids, vocab_size=2_000, tokenizer=f"v{number % 2}")
"""


@pytest.mark.slow
def test_a_reader_sees_the_old_or_the_new_shard_while_another_process_rewrites_it(
    tmp_path,
):
    path = write_shard(
        tmp_path / "s.bin", np.arange(1_000), vocab_size=2_000, tokenizer="v0"
    )
    rewriter = subprocess.Popen(
        [sys.executable, "-c", REWRITER, str(path), "150"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert rewriter.stdout.readline().strip() == "started"
    reads, failures = 0, []
    while rewriter.poll() is None:
        try:
            ids = np.array(open_shard(path))
            if not np.array_equal(ids, np.arange(len(ids))) or len(ids) not in (
                1_000,
                2_000,
            ):
                failures.append(f"read {len(ids)} ids that are neither version")
        except Exception as error:
            failures.append(f"{type(error).__name__}: {error}")
        reads += 1
    assert rewriter.wait() == 0
    assert reads > 50, (
        "the reader barely overlapped the rewrites; the test proves nothing"
    )
    assert failures == [], (
        f"{len(failures)} of {reads} reads failed, first: {failures[:2]}"
    )


STALE_STREAM = """
import sys, numpy as np
from torchbook.data import StreamConfig, TokenStream
from torchbook.shards import ShardError, write_shard
ids = np.arange(200_000) % 1_000
path = write_shard(sys.argv[1], ids, vocab_size=1_000, tokenizer="t")
stream = TokenStream([path], StreamConfig(block_size=64, batch_size=8, shuffle=False))
# what another process might do
write_shard(path, np.arange(1_000), vocab_size=1_000, tokenizer="t")
try:
    for batch in stream:
        pass
    print("iterated to the end")
except ShardError as error:
    print("ShardError:", error)
"""


@pytest.mark.slow
def test_a_stream_whose_shard_was_rewritten_shorter_is_refused_not_read_past_its_end(
    tmp_path,
):
    # In a subprocess: reading past a mapping's end kills the whole process (SIGBUS).
    done = subprocess.run(
        [sys.executable, "-c", STALE_STREAM, str(tmp_path / "s.bin")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, (
        f"the reader died with code {done.returncode}: {done.stderr[-500:]}"
    )
    assert (
        "ShardError:" in done.stdout
        and "s.bin: holds 1,000 uint16 tokens, but 200,000" in done.stdout
    ), done.stdout


# -- the stream -----------------------------------------------------------------


def test_y_is_x_shifted_by_one_and_both_are_slices_of_the_shards(tmp_path):
    paths = counting_shards(tmp_path)
    stream = TokenStream(paths, StreamConfig(block_size=16, batch_size=4, seed=3))
    for x, y in stream:
        assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (4, 16)
        # the counting data makes the expected block arithmetic: token i is the number i
        expected = x[:, :1] + torch.arange(16)
        assert torch.equal(x, expected)
        assert torch.equal(y, expected + 1)


def test_unused_tail_tokens_are_exactly_those_in_no_block(tmp_path):
    sizes = [700, 700, 10, 590]  # the third shard is shorter than one block
    paths, start = [], 0
    for number, size in enumerate(sizes):
        paths.append(
            write_shard(
                tmp_path / f"s{number}.bin",
                np.arange(start, start + size),
                vocab_size=2_000,
                tokenizer="counting",
            )
        )
        start += size
    stream = TokenStream(
        paths, StreamConfig(block_size=16, batch_size=1, shuffle=False)
    )
    covered = set()
    for x, y in stream:
        covered |= set(x.flatten().tolist()) | set(y.flatten().tolist())
    assert stream.unused_tail_tokens == sum(sizes) - len(covered)


def test_no_block_crosses_a_shard_boundary(tmp_path):
    paths = counting_shards(tmp_path, num_tokens=2_000, tokens_per_shard=700)
    stream = TokenStream(
        paths, StreamConfig(block_size=16, batch_size=1, shuffle=False)
    )
    starts = torch.cat([x[:, 0] for x, _ in stream])
    shard_of_first, shard_of_last = starts // 700, (starts + 16) // 700
    assert torch.equal(shard_of_first, shard_of_last)


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("num_workers", [1, 2, 3])
@pytest.mark.parametrize("shuffle", [False, True])
def test_workers_and_ranks_read_every_block_once_per_epoch(
    tmp_path, monkeypatch, world_size, num_workers, shuffle
):
    paths = counting_shards(tmp_path, num_tokens=2_000, tokens_per_shard=700)
    block, batch = 16, 5
    seen, per_rank, dropped = [], [], None
    for rank in range(world_size):
        config = StreamConfig(
            block_size=block,
            batch_size=batch,
            shuffle=shuffle,
            seed=7,
            rank=rank,
            world_size=world_size,
        )
        rank_batches = 0
        for worker in range(num_workers):
            stream = TokenStream(paths, config)
            info = SimpleNamespace(num_workers=num_workers, id=worker)
            batches = read_all(stream, info, monkeypatch)
            rank_batches += len(batches)
            seen += [int(start) for x, _ in batches for start in x[:, 0]]
        per_rank.append(rank_batches)
        dropped = stream.dropped_blocks_per_epoch
    # every block start, computed independently from the shard lengths
    all_starts = {
        s + 700 * k
        for k in range(3)
        for s in range(0, min(700, 2_000 - 700 * k) - block, block)
    }
    assert len(seen) == len(set(seen)), "a block was read twice"
    assert set(seen) <= all_starts
    assert len(all_starts) - len(seen) == dropped, (
        "blocks left out differ from the reported count"
    )
    assert dropped < world_size * batch, (
        "more was dropped than needed to equalize ranks"
    )
    assert len(set(per_rank)) == 1, (
        f"ranks got different numbers of batches: {per_rank}"
    )


def test_dataloader_workers_deliver_the_single_process_order(tmp_path):
    paths = counting_shards(tmp_path)
    stream = TokenStream(
        paths, StreamConfig(block_size=16, batch_size=4, seed=1, epochs=2)
    )
    expected = [x for x, _ in stream]
    loader = DataLoader(stream, batch_size=None, num_workers=2)
    got = [x for x, _ in loader]
    assert len(got) == len(expected) == len(loader)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def test_same_seed_gives_the_same_order_and_another_seed_or_epoch_does_not(tmp_path):
    paths = counting_shards(tmp_path)

    def starts(seed, epochs=1):
        stream = TokenStream(
            paths, StreamConfig(block_size=16, batch_size=4, seed=seed, epochs=epochs)
        )
        return torch.cat([x[:, 0] for x, _ in stream])

    assert torch.equal(starts(5), starts(5))
    assert not torch.equal(starts(5), starts(6))
    two_epochs = starts(5, epochs=2)
    first, second = two_epochs.chunk(2)
    assert not torch.equal(first, second), "every epoch reused the same order"
    assert torch.equal(first, starts(5))


@pytest.mark.parametrize("cut", [0, 1, 7, 29, 30, 31, 45])
def test_resume_from_a_saved_position_continues_exactly(tmp_path, cut):
    paths = counting_shards(tmp_path)
    config = StreamConfig(block_size=16, batch_size=4, seed=2, epochs=2)
    full = [x for x, _ in TokenStream(paths, config)]
    assert len(full) > 45  # the cuts include the epoch boundary (30 batches per epoch)
    resumed = TokenStream(paths, config)
    resumed.load_state_dict(TokenStream(paths, config).state_dict(batches_consumed=cut))
    rest = [x for x, _ in resumed]
    assert len(rest) == len(full) - cut
    assert all(torch.equal(a, b) for a, b in zip(rest, full[cut:], strict=True))


def test_resume_with_dataloader_workers_counts_batches_the_loop_consumed(tmp_path):
    paths = counting_shards(tmp_path)
    config = StreamConfig(block_size=16, batch_size=4, seed=2, epochs=2)
    stream = TokenStream(paths, config)
    full = [x for x, _ in stream]
    consumed, state = 0, None
    for _batch in DataLoader(stream, batch_size=None, num_workers=2, prefetch_factor=4):
        consumed += 1
        if consumed == 11:  # the workers have prefetched well past this batch
            state = stream.state_dict(batches_consumed=consumed)
            break
    resumed = TokenStream(paths, config)
    resumed.load_state_dict(state)
    rest = [x for x, _ in DataLoader(resumed, batch_size=None, num_workers=1)]
    assert (
        all(torch.equal(a, b) for a, b in zip(rest, full[11:], strict=True))
        and len(rest) == len(full) - 11
    )


def test_resume_refuses_a_position_saved_with_another_configuration(tmp_path):
    paths = counting_shards(tmp_path)
    state = TokenStream(paths, StreamConfig(block_size=16, batch_size=4)).state_dict(
        batches_consumed=3
    )
    other = TokenStream(paths, StreamConfig(block_size=16, batch_size=8))
    with pytest.raises(ValueError, match="batch_size saved 4 but this stream has 8"):
        other.load_state_dict(state)
    assert other.start_batch == 0


def test_stream_reads_uint32_shards_of_a_large_vocabulary(tmp_path):
    vocab_size = 100_000  # above 65,536: stored as uint32
    tokens = np.random.default_rng(2).integers(0, vocab_size, 1_000)
    tokens[:3] = [vocab_size - 1, 65_536, 70_000]  # ids a uint16 would wrap
    shard = write_shard(
        tmp_path / "s.bin", tokens, vocab_size=vocab_size, tokenizer="big"
    )
    assert read_header(shard).dtype == "uint32"
    stream = TokenStream(
        [shard], StreamConfig(block_size=16, batch_size=4, shuffle=False)
    )
    x, y = next(iter(stream))
    assert x.dtype == torch.int64
    assert torch.equal(x, torch.from_numpy(tokens[: 64 + 1][: 4 * 16]).view(4, 16))
    assert torch.equal(y[:, -1], torch.from_numpy(tokens[16:65:16]))


def test_stream_pickles_paths_not_mapped_data(tmp_path):
    paths = counting_shards(tmp_path, num_tokens=50_000, tokens_per_shard=50_000)
    stream = TokenStream(paths, StreamConfig(block_size=16, batch_size=4))
    next(iter(stream))  # maps the shard in this process
    clone = pickle.loads(pickle.dumps(stream))
    # 50,000 uint16 ids are 100,000 bytes; the block table is about 3,100 x 12 bytes
    assert len(pickle.dumps(stream)) < 100_000
    assert torch.equal(next(iter(clone))[0], next(iter(stream))[0])


# ----------------------------------------------------------------- wrongly typed inputs


@pytest.mark.parametrize(
    "vocab_size, tokenizer, message",
    [
        ("100", "t", r"vocab_size='100'"),
        (0, "t", r"vocab_size=0"),
        (100, 5, r"tokenizer=5"),
    ],
)
def test_write_shard_refuses_arguments_of_the_wrong_type_naming_the_file(
    tmp_path, vocab_size, tokenizer, message
):
    # a non-string tokenizer used to be written, then refused by every header reader
    with pytest.raises(
        ShardError, match=rf"s\.bin: expected a \.bin path, .*{message}"
    ):
        write_shard(
            tmp_path / "s.bin", [1, 2, 3], vocab_size=vocab_size, tokenizer=tokenizer
        )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "shards", [[1, 2], ["../../elsewhere.bin"], ["sub/shard_000.bin"], "shard_000.bin"]
)
def test_an_index_listing_anything_but_file_names_in_its_folder_is_refused(
    tmp_path, shards
):
    counting_shards(tmp_path)
    index = index_path(tmp_path)
    index.write_text(json.dumps({**json.loads(index.read_text()), "shards": shards}))
    with pytest.raises(
        ShardError, match=r"shard_index\.json: no index of \.bin files in its folder"
    ):
        read_shards(tmp_path)


def test_a_cache_cut_at_another_shard_size_is_rebuilt(tmp_path):
    first = cached_shards(
        tmp_path,
        lambda: np.arange(2_000),
        vocab_size=2_000,
        tokenizer="c",
        tokens_per_shard=700,
    )
    again = cached_shards(
        tmp_path,
        lambda: np.arange(2_000),
        vocab_size=2_000,
        tokenizer="c",
        tokens_per_shard=1_000,
    )
    assert (len(first), len(again)) == (3, 2)
    assert [read_header(path).num_tokens for path in again] == [1_000, 1_000]


@pytest.mark.parametrize(
    "damage",
    [
        lambda state: None,
        lambda state: {**state, "batches_consumed": "3"},
        lambda state: {**state, "batches_consumed": True},
    ],
)
def test_a_stream_position_of_the_wrong_type_is_refused(tmp_path, damage):
    stream = TokenStream(
        counting_shards(tmp_path), StreamConfig(block_size=16, batch_size=4)
    )
    with pytest.raises(ValueError, match="lacks or adds to the keys|batches_consumed="):
        stream.load_state_dict(damage(stream.state_dict(batches_consumed=3)))
    assert stream.start_batch == 0


def test_a_rebuilt_cache_leaves_no_temporary_of_a_killed_write(tmp_path):
    cached_shards(
        tmp_path,
        lambda: np.arange(2_000),
        vocab_size=2_000,
        tokenizer="c",
        tokens_per_shard=700,
    )
    (tmp_path / f".shard_001.bin{files.TEMPORARY_MARKER}abcd1234").write_bytes(
        b"half a shard"
    )
    index_path(tmp_path).unlink()  # the kill came before the index
    healed = cached_shards(
        tmp_path,
        lambda: np.arange(2_000),
        vocab_size=2_000,
        tokenizer="c",
        tokens_per_shard=700,
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == cache_files(healed)
