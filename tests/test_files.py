"""The one atomic writer (code/torchbook/files.py): old file or new file, never half of one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from torchbook import files
from torchbook.files import atomic_write, atomic_write_text, is_temporary


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
        atomic_write(tmp_path / "out.bin", lambda temporary: (seen.append(temporary), temporary.write_bytes(b"x")))
    first, second = seen
    # same folder: os.replace is only atomic within one file system
    assert first.parent == second.parent == tmp_path
    assert first.name != second.name, "two writes of one file must not share a temporary"
    assert all(is_temporary(path) and path.name.startswith(".out.bin") for path in seen)
    assert not is_temporary(tmp_path / "out.bin")


def test_file_and_folder_are_fsynced_before_and_after_the_rename(tmp_path, monkeypatch):
    synced = []
    real_fsync_path = files.fsync_path
    monkeypatch.setattr(files, "fsync_path", lambda path: (synced.append(Path(path)), real_fsync_path(path)))
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
