"""Write a file so that a crash at any moment leaves the old file or the new one, whole.

Every module of the book that writes something a later run trusts (a
checkpoint, a token shard, a downloaded data set, a results file) goes through
``atomic_write``. The recipe is the one databases use:

1. write the content to a temporary file in the *same folder*, under a unique name
   (``O_EXCL`` on a random suffix), so two writers never share a temporary and a rename
   never crosses file systems;
2. ``fsync`` the temporary: its bytes are on the disk, not only in the page cache;
3. ``os.replace`` it over the final name: atomic on POSIX and Windows;
4. ``fsync`` the folder: the rename itself is on the disk.

If ``write`` raises, or the process is killed, the final name still holds the
previous content (or does not exist); only a hidden temporary can be left
behind, and its name (``.<name>.tmp-XXXXXXXX``) never matches the final one.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from pathlib import Path

# Temporaries are ".<final name>.tmp-<random>": hidden, never taken for the final file.
TEMPORARY_MARKER = ".tmp-"


def fsync_path(path: str | Path) -> None:
    """Flush a file's (or a folder's) data and metadata to the disk."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def is_temporary(path: str | Path) -> bool:
    """True for an ``atomic_write`` temporary (a leftover from an interrupted write)."""
    name = Path(path).name
    return name.startswith(".") and TEMPORARY_MARKER in name


def _new_temporary(path: Path) -> Path:
    """Create an empty, uniquely named temporary beside ``path``.

    ``tempfile.mkstemp`` would do, but it creates the file readable by its
    owner only (0600), and the rename would carry that mode to the final
    file; ``os.open`` with mode 0666 lets the umask decide, as a plain
    ``open`` does.
    """
    while True:
        temporary = (
            path.parent / f".{path.name}{TEMPORARY_MARKER}{secrets.token_hex(4)}"
        )
        try:
            os.close(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return temporary
        except FileExistsError:
            continue  # another writer drew the same name: draw again


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> Path:
    """Fill a temporary with ``write(temporary)``, then move it to ``path`` atomically.

    Returns ``path``. On any error the temporary is removed and ``path`` is
    left as it was. A system error (a full disk, a read-only folder) is raised
    again as an ``OSError`` of the same errno whose message names ``path``
    (the hidden temporary's name would tell a reader nothing); any other error
    propagates unchanged, for the caller to name the file.
    """
    path = Path(path)
    temporary = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = _new_temporary(path)
        write(temporary)
        fsync_path(temporary)
        os.replace(temporary, path)
    except BaseException as error:
        if temporary is not None:
            temporary.unlink(missing_ok=True)
        # not the system's (a URLError): unchanged
        if not isinstance(error, OSError) or error.errno is None:
            raise
        # OSError(errno, text) gives the subclass of that errno: PermissionError, ...
        raise OSError(
            error.errno,
            f"{path}: could not be written ({error.strerror}); it is unchanged",
        ) from error
    fsync_path(path.parent)
    return path


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """``atomic_write`` for content already in memory."""
    return atomic_write(path, lambda temporary: temporary.write_bytes(data))


def atomic_write_text(path: str | Path, text: str) -> Path:
    """``atomic_write`` for text, encoded as UTF-8."""
    return atomic_write_bytes(path, text.encode("utf-8"))
