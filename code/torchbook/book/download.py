"""Find, download and verify the book's data sets, and say where derived files go.

Two folders, two rules:

- The **data folder** holds the raw files exactly as published: MNIST in
  torchvision's ``MNIST/raw`` layout and Tiny Shakespeare as
  ``tinyshakespeare/input.txt``. When the environment variable
  ``BOOK_DATA_DIR`` names a folder, that folder is used as it is, read-only,
  and nothing is downloaded. Otherwise the files are downloaded once into
  ``.cache/data`` and every file is checked against its SHA-256.
- The **cache folder** (``BOOK_CACHE_DIR``, default ``.cache`` in the
  repository) receives everything derived from the data: token shards,
  tokenizers, checkpoints, figures. It is never inside ``BOOK_DATA_DIR``.

Run ``python -m torchbook.book.download`` to fetch (or check) everything up front.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import shutil
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from torchbook.files import atomic_write

DATA_VARIABLE = "BOOK_DATA_DIR"
CACHE_VARIABLE = "BOOK_CACHE_DIR"
DOWNLOAD_TIMEOUT_S = 60
CHUNK_BYTES = 1 << 20


class DataError(RuntimeError):
    """A data file is missing, cannot be fetched, or is not the file we expect."""


@dataclass(frozen=True)
class DataFile:
    """One published file: where it lives under the data folder and how to get it."""

    path: str  # relative to the data folder, e.g. "MNIST/raw/t10k-labels-idx1-ubyte"
    url: str  # canonical source
    sha256: str  # of the file as stored (after unpacking, for .gz sources)

    @property
    def gzipped(self) -> bool:
        return self.url.endswith(".gz")


_MNIST_URL = "https://ossci-datasets.s3.amazonaws.com/mnist/"
_SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"

DATASETS: dict[str, tuple[DataFile, ...]] = {
    "mnist": (
        DataFile(
            "MNIST/raw/train-images-idx3-ubyte",
            _MNIST_URL + "train-images-idx3-ubyte.gz",
            "ba891046e6505d7aadcbbe25680a0738ad16aec93bde7f9b65e87a2fc25776db",
        ),
        DataFile(
            "MNIST/raw/train-labels-idx1-ubyte",
            _MNIST_URL + "train-labels-idx1-ubyte.gz",
            "65a50cbbf4e906d70832878ad85ccda5333a97f0f4c3dd2ef09a8a9eef7101c5",
        ),
        DataFile(
            "MNIST/raw/t10k-images-idx3-ubyte",
            _MNIST_URL + "t10k-images-idx3-ubyte.gz",
            "0fa7898d509279e482958e8ce81c8e77db3f2f8254e26661ceb7762c4d494ce7",
        ),
        DataFile(
            "MNIST/raw/t10k-labels-idx1-ubyte",
            _MNIST_URL + "t10k-labels-idx1-ubyte.gz",
            "ff7bcfd416de33731a308c3f266cc351222c34898ecbeaf847f06e48f7ec33f2",
        ),
    ),
    "tinyshakespeare": (
        DataFile(
            "tinyshakespeare/input.txt",
            _SHAKESPEARE_URL,
            "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed",
        ),
    ),
}


def repository_root() -> Path:
    """This package's checkout, or the working directory if it was copied elsewhere."""
    candidate = Path(__file__).resolve().parents[3]  # code/torchbook/book/download.py
    if (candidate / "pyproject.toml").is_file():
        return candidate
    return Path.cwd().resolve()


def cache_dir() -> Path:
    """The writable cache folder (``BOOK_CACHE_DIR`` or ``.cache``), made if missing."""
    configured = os.environ.get(CACHE_VARIABLE)
    folder = (
        Path(configured).expanduser() if configured else repository_root() / ".cache"
    )
    folder = folder.resolve()
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def data_dir() -> Path:
    """The raw data sets' folder: ``BOOK_DATA_DIR`` if set, else ``<cache>/data``."""
    configured = os.environ.get(DATA_VARIABLE)
    if configured:
        folder = Path(configured).expanduser().resolve()
        if not folder.is_dir():
            raise DataError(f"{DATA_VARIABLE}={configured}: no such folder")
        return folder
    folder = cache_dir() / "data"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def sha256_of(path: Path) -> str:
    """SHA-256 of a file, read in 1 MiB chunks so large files need no memory."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(CHUNK_BYTES), b""):
            digest.update(chunk)
    return digest.hexdigest()


def verify(path: Path, expected_sha256: str) -> None:
    """Raise DataError, naming the file, unless its SHA-256 is ``expected_sha256``."""
    if not Path(path).is_file():
        raise DataError(
            f"{path}: missing (or not a file); "
            f"expected the file whose SHA-256 is {expected_sha256}"
        )
    actual = sha256_of(path)
    if actual != expected_sha256:
        raise DataError(
            f"{path}: SHA-256 is {actual}, expected {expected_sha256}; "
            "the file is corrupt or not the published one. Delete it and fetch again."
        )


def download(spec: DataFile, root: Path, url: str | None = None) -> Path:
    """Download ``spec`` into ``root``, gunzip it if needed, verify, move into place.

    The bytes go to a temporary next to the target through
    ``torchbook.files.atomic_write`` (unique name, fsync, rename, fsync of the
    folder), and the SHA-256 is checked before the rename: the file appears
    under its final name only once it is whole and verified, so an interrupted
    or corrupt download never looks like a good one.
    """
    source = url or spec.url
    target = root / spec.path

    def fetch_and_verify(temporary: Path) -> None:
        with (
            open(temporary, "wb") as out,
            urllib.request.urlopen(source, timeout=DOWNLOAD_TIMEOUT_S) as response,
        ):
            stream = gzip.GzipFile(fileobj=response) if spec.gzipped else response
            shutil.copyfileobj(stream, out, CHUNK_BYTES)
        actual = sha256_of(temporary)
        if actual != spec.sha256:
            raise DataError(
                f"{target}: downloaded from {source}, SHA-256 is {actual}, "
                f"expected {spec.sha256}; the file was not kept."
            )

    try:
        return atomic_write(target, fetch_and_verify)
    except OSError as error:  # network errors (URLError) and disk errors alike
        raise DataError(f"{target}: could not download {source}: {error}") from error


def ensure(name: str, mirror: str | None = None) -> Path:
    """The data folder, once every file of data set ``name`` is there and verified.

    With ``BOOK_DATA_DIR`` set, files are only checked, never downloaded.
    ``mirror`` replaces the canonical base URL (used by the tests' local server).
    """
    if name not in DATASETS:
        raise DataError(
            f"unknown data set {name!r}; expected one of {sorted(DATASETS)}"
        )
    root = data_dir()
    offline = bool(os.environ.get(DATA_VARIABLE))
    for spec in DATASETS[name]:
        path = root / spec.path
        if path.is_file():
            verify(path, spec.sha256)
        elif offline:
            raise DataError(
                f"{path}: missing. {DATA_VARIABLE} is set, so nothing is downloaded; "
                f"put the published file there or unset {DATA_VARIABLE}."
            )
        else:
            url = (
                mirror.rstrip("/") + "/" + spec.url.rsplit("/", 1)[1]
                if mirror
                else None
            )
            download(spec, root, url)
    return root


def mnist_root() -> Path:
    """The ``root=`` for ``torchvision.datasets.MNIST`` (it holds ``MNIST/raw``)."""
    return ensure("mnist")


def shakespeare_path() -> Path:
    """Path of Tiny Shakespeare's ``input.txt`` (about 1.1 MB of plain text)."""
    return ensure("tinyshakespeare") / "tinyshakespeare" / "input.txt"


def main() -> int:
    """Fetch or check every data set; print where they are."""
    try:
        for name in DATASETS:
            root = ensure(name)
            print(f"{name}: verified in {root}")
    except DataError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"derived files go to {cache_dir()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
