"""The one atomic writer (torchbook/files.py): old file or new, never half of one."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pytest

from torchbook import files
from torchbook.files import (
    atomic_write,
    atomic_write_bytes,
    atomic_write_text,
    is_temporary,
)


def test_a_failing_writer_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "weights.pt"
    path.write_bytes(b"old and whole")

    def write_half_then_fail(temporary: Path) -> None:
        temporary.write_bytes(b"new but")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(path, write_half_then_fail)
    assert path.read_bytes() == b"old and whole"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["weights.pt"]


def test_the_temporary_is_hidden_unique_and_next_to_the_target(tmp_path):
    seen = []
    for _ in range(2):
        atomic_write(
            tmp_path / "out.bin",
            lambda temporary: (seen.append(temporary), temporary.write_bytes(b"x")),
        )
    first, second = seen
    # same folder: os.replace is only atomic within one file system
    assert first.parent == second.parent == tmp_path
    assert first.name != second.name, (
        "two writes of one file must not share a temporary"
    )
    assert all(is_temporary(path) and path.name.startswith(".out.bin") for path in seen)
    assert not is_temporary(tmp_path / "out.bin")


def test_file_and_folder_are_fsynced_before_and_after_the_rename(tmp_path, monkeypatch):
    synced = []
    real_fsync_path = files.fsync_path
    monkeypatch.setattr(
        files,
        "fsync_path",
        lambda path: (synced.append(Path(path)), real_fsync_path(path)),
    )
    target = atomic_write_text(tmp_path / "notes.txt", "héllo")
    assert target.read_text(encoding="utf-8") == "héllo"
    assert len(synced) == 2 and is_temporary(synced[0]) and synced[1] == tmp_path


def test_missing_folders_are_created(tmp_path):
    target = atomic_write_text(tmp_path / "a" / "b" / "c.txt", "deep")
    assert target.read_text() == "deep"


def test_an_interrupt_inside_the_writer_also_removes_the_temporary(tmp_path):
    def interrupted(temporary: Path) -> None:
        temporary.write_bytes(b"partial")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write(tmp_path / "out.bin", interrupted)
    assert os.listdir(tmp_path) == []


def test_a_full_disk_names_the_file_keeps_the_errno_and_the_old_file(
    tmp_path, monkeypatch
):
    path = tmp_path / "shard.bin"
    path.write_bytes(b"old and whole")

    def no_space(descriptor: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    with pytest.raises(OSError) as raised:
        atomic_write_text(path, "new")
    # shards, results, tokenizers and safetensors indexes all get the name from here
    assert str(path) in str(raised.value) and raised.value.errno == errno.ENOSPC
    assert path.read_bytes() == b"old and whole"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard.bin"]


def test_a_read_only_folder_is_a_permission_error_naming_the_file(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        if os.access(folder, os.W_OK):
            pytest.skip("running as a user who may write anywhere (root)")
        with pytest.raises(PermissionError, match="ro/out.txt"):
            atomic_write_text(folder / "out.txt", "x")
    finally:
        folder.chmod(0o755)


def test_an_error_that_is_not_the_systems_propagates_unchanged(tmp_path):
    class NetworkError(OSError):  # like urllib's URLError: an OSError without an errno
        pass

    def fail(temporary: Path) -> None:
        raise NetworkError("name or service not known")

    with pytest.raises(NetworkError, match="^name or service not known$"):
        atomic_write(tmp_path / "download.txt", fail)
    assert os.listdir(tmp_path) == []


def test_the_written_file_gets_the_mode_a_plain_open_would_give(tmp_path):
    # mkstemp's 0600 must not reach the final file: the umask decides, as for open().
    old_umask = os.umask(0o022)
    try:
        atomic_write_bytes(tmp_path / "shared.bin", b"data")
        (tmp_path / "plain.bin").write_bytes(b"data")
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE((tmp_path / "shared.bin").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "shared.bin").stat().st_mode) == stat.S_IMODE(
        (tmp_path / "plain.bin").stat().st_mode
    )
