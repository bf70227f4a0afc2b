"""The data cache: offline use of BOOK_DATA_DIR, verified downloads, clear refusals."""

from __future__ import annotations

import gzip
import http.server
import threading
import urllib.request
from pathlib import Path

import pytest

from torchbook.book import download
from torchbook.files import is_temporary


@pytest.fixture
def published_copy(tmp_path_factory) -> Path:
    """A folder of the real published files, served gzipped like the MNIST mirror."""
    # the data folder the suite runs with (BOOK_DATA_DIR or the cache)
    source = download.ensure("mnist")
    served = tmp_path_factory.mktemp("served")
    for spec in download.DATASETS["mnist"]:
        name = spec.url.rsplit("/", 1)[1]
        with (
            open(source / spec.path, "rb") as raw,
            gzip.open(served / name, "wb", compresslevel=1) as packed,
        ):
            packed.write(raw.read())
    return served


@pytest.fixture
def local_server(published_copy):
    """An HTTP server on 127.0.0.1 serving the gzipped copies; yields its base URL."""
    handler = lambda *args: http.server.SimpleHTTPRequestHandler(  # noqa: E731
        *args, directory=str(published_copy)
    )
    http.server.SimpleHTTPRequestHandler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch) -> Path:
    """No BOOK_DATA_DIR, an empty BOOK_CACHE_DIR: as on a reader's first run."""
    monkeypatch.delenv(download.DATA_VARIABLE, raising=False)
    monkeypatch.setenv(download.CACHE_VARIABLE, str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.slow
def test_download_unpacks_and_verifies_gzipped_files(local_server, fresh_cache):
    root = download.ensure("mnist", mirror=local_server)
    assert root == fresh_cache / "data"
    for spec in download.DATASETS["mnist"]:
        stored = root / spec.path
        # Independent check: hash the stored file ourselves.
        assert download.sha256_of(stored) == spec.sha256
    assert not [path for path in root.rglob("*") if is_temporary(path)], (
        "no temporary file may be left behind"
    )


@pytest.mark.slow
def test_second_call_does_not_download_again(local_server, fresh_cache, monkeypatch):
    download.ensure("mnist", mirror=local_server)

    def no_network(*args, **kwargs):
        raise AssertionError(
            "ensure() went to the network although the files were there"
        )

    monkeypatch.setattr(urllib.request, "urlopen", no_network)
    download.ensure("mnist", mirror=local_server)


def test_corrupt_download_is_refused_naming_file_and_both_hashes(tmp_path, fresh_cache):
    served = tmp_path / "served"
    served.mkdir()
    spec = download.DataFile("demo/file.txt", "unused", "0" * 64)
    bad = served / "file.txt"
    bad.write_bytes(b"not the published bytes")
    with pytest.raises(download.DataError) as error:
        download.download(spec, fresh_cache, url=bad.as_uri())
    message = str(error.value)
    assert "demo/file.txt" in message
    assert download.sha256_of(bad) in message and "0" * 64 in message
    assert not (fresh_cache / "demo" / "file.txt").exists(), (
        "a file that failed its check must not be kept"
    )
    assert list((fresh_cache / "demo").iterdir()) == [], (
        "the temporary must be removed too"
    )


def test_a_verified_download_goes_through_the_one_atomic_writer(
    tmp_path, fresh_cache, monkeypatch
):
    served = tmp_path / "served"
    served.mkdir()
    (served / "file.txt").write_bytes(b"the published bytes")
    spec = download.DataFile(
        "demo/file.txt", "unused", download.sha256_of(served / "file.txt")
    )
    written = []
    real_atomic_write = download.atomic_write

    def recording_atomic_write(path, write):
        written.append(Path(path))
        return real_atomic_write(path, write)

    monkeypatch.setattr(download, "atomic_write", recording_atomic_write)
    target = download.download(spec, fresh_cache, url=(served / "file.txt").as_uri())
    assert written == [fresh_cache / "demo" / "file.txt"] == [target]
    assert target.read_bytes() == b"the published bytes"


def test_wrong_checksum_in_data_dir_is_refused(tmp_path, monkeypatch):
    folder = tmp_path / "data" / "tinyshakespeare"
    folder.mkdir(parents=True)
    (folder / "input.txt").write_text("To be, or not to be", encoding="utf-8")
    monkeypatch.setenv(download.DATA_VARIABLE, str(tmp_path / "data"))
    with pytest.raises(
        download.DataError,
        match=r"tinyshakespeare/input\.txt: SHA-256 is [0-9a-f]{64}, expected 86c4e6aa",
    ):
        download.shakespeare_path()


def test_data_dir_set_never_downloads(tmp_path, monkeypatch):
    monkeypatch.setenv(download.DATA_VARIABLE, str(tmp_path))

    def no_network(*args, **kwargs):
        raise AssertionError("went to the network although BOOK_DATA_DIR is set")

    monkeypatch.setattr(urllib.request, "urlopen", no_network)
    with pytest.raises(
        download.DataError, match=r"input\.txt: missing\. BOOK_DATA_DIR is set"
    ):
        download.shakespeare_path()


def test_unreachable_source_is_a_clear_error(fresh_cache):
    with pytest.raises(
        download.DataError, match=r"could not download http://127\.0\.0\.1:9/"
    ):
        download.ensure("tinyshakespeare", mirror="http://127.0.0.1:9")


def test_derived_files_go_to_the_cache_not_the_data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(download.DATA_VARIABLE, str(tmp_path / "readonly"))
    (tmp_path / "readonly").mkdir()
    monkeypatch.setenv(download.CACHE_VARIABLE, str(tmp_path / "derived"))
    assert download.cache_dir() == (tmp_path / "derived").resolve()
    assert download.data_dir() == (tmp_path / "readonly").resolve()


def test_relative_folders_are_resolved_to_absolute_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(download.CACHE_VARIABLE, "relative-cache")
    folder = download.cache_dir()
    assert folder.is_absolute() and folder == tmp_path / "relative-cache"


def test_missing_data_dir_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv(download.DATA_VARIABLE, str(tmp_path / "nowhere"))
    with pytest.raises(
        download.DataError, match=r"BOOK_DATA_DIR=.*nowhere: no such folder"
    ):
        download.data_dir()


def test_verifying_a_missing_file_names_it(tmp_path):
    with pytest.raises(download.DataError, match=r"nothing\.gz: missing"):
        download.verify(tmp_path / "nothing.gz", "0" * 64)


def test_the_repository_root_of_the_checkout_is_the_folder_of_its_examples():
    # Not the working directory: a chapter runs in chapters/, and its jobs must still
    # find examples/ (the module moved one folder down once, and this went unnoticed).
    root = download.repository_root()
    assert root == Path(__file__).resolve().parents[1]
    assert (root / "examples" / "train_ddp.py").is_file()
