"""make book's Quarto: the one on PATH if new enough, else the pinned quarto-cli.

Both branches run without the network: a stand-in ``quarto`` prints a version, and a
stand-in interpreter plays pip, recording what it was asked and failing as offline
pip does.
"""

from __future__ import annotations

import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from find_quarto import PINNED, find_quarto  # noqa: E402


def stand_in(path: Path, body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\n{body}\n", encoding="utf-8")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def offline_python(tmp_path: Path) -> Path:
    """An interpreter whose pip notes its arguments, then fails as offline pip does."""
    log = tmp_path / "pip-calls.txt"
    return stand_in(tmp_path / "venv" / "bin" / "python", f'echo "$@" >> {log}\nexit 1')


def test_a_new_enough_quarto_on_path_is_used_and_nothing_is_installed(tmp_path):
    quarto = stand_in(tmp_path / "path" / "quarto", "echo 1.9.38")
    python = offline_python(tmp_path)
    assert find_quarto(str(python), str(quarto.parent)) == str(quarto)
    assert not (tmp_path / "pip-calls.txt").exists()


def test_without_quarto_the_pinned_quarto_cli_is_installed_into_the_venv(tmp_path):
    # pip stands in: it "installs" by writing the quarto that quarto-cli provides.
    venv_bin = tmp_path / "venv" / "bin"
    installed = venv_bin / "quarto"
    python = stand_in(
        venv_bin / "python",
        f'echo "$@" >> {tmp_path / "pip-calls.txt"}\n'
        f"printf '#!/bin/sh\\necho 1.9.38\\n' > {installed}\nchmod +x {installed}",
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    assert find_quarto(str(python), str(empty)) == str(installed)
    calls = (tmp_path / "pip-calls.txt").read_text(encoding="utf-8")
    assert f"-m pip install --quiet {PINNED}" in calls


def test_an_old_quarto_on_path_is_not_used(tmp_path):
    stand_in(tmp_path / "path" / "quarto", "echo 1.8.27")
    python = offline_python(tmp_path)
    with pytest.raises(RuntimeError, match="older than 1.9"):
        find_quarto(str(python), str(tmp_path / "path"))


def test_offline_the_install_fails_with_one_clear_message_and_changes_nothing(tmp_path):
    python = offline_python(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(RuntimeError) as refusal:
        find_quarto(str(python), str(empty))
    message = str(refusal.value)
    assert "no quarto on PATH" in message and PINNED in message
    assert "needs internet" in message
    # the only new file is the stand-in pip's own note of its call
    assert sorted(tmp_path.rglob("*")) == sorted([*before, tmp_path / "pip-calls.txt"])


def test_make_book_renders_with_the_quarto_this_script_prints():
    recipe = subprocess.run(
        ["make", "-n", "book"], cwd=ROOT, capture_output=True, text=True, check=False
    ).stdout
    assert "tools/find_quarto.py" in recipe and "render" in recipe
