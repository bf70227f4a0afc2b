#!/usr/bin/env python3
"""Print the Quarto that `make book` renders with; install the pinned one if needed.

A ``quarto`` of at least 1.9 on ``PATH`` is used as it is. Otherwise the pinned
``quarto-cli`` from PyPI is installed into the interpreter's environment (the
``.venv``), whose ``bin`` then holds a ``quarto``. Offline that install fails: this
then says so in one message and exits 1, having changed nothing else (pip installs
nothing when it cannot fetch a package).

Usage: ``python tools/find_quarto.py`` prints the command's path on its last line.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

MINIMUM = (1, 9)  # books render their PDF with Typst from Quarto 1.9 on
PINNED = "quarto-cli==1.9.38"  # the version the book is rendered with


def version_of(quarto: str) -> tuple[int, ...] | None:
    """The version ``quarto --version`` prints, or None if it does not run."""
    try:
        printed = subprocess.run(
            [quarto, "--version"], capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    try:
        return tuple(int(part) for part in printed.strip().split(".")[:2])
    except ValueError:
        return None


def usable(quarto: str | None) -> bool:
    if quarto is None:
        return False
    version = version_of(quarto)
    return version is not None and version >= MINIMUM


def find_quarto(python: str, search_path: str | None) -> str:
    """The Quarto to render with: on ``search_path``, else installed beside ``python``.

    Raises ``RuntimeError`` with the reason when neither works.
    """
    on_path = shutil.which("quarto", path=search_path)
    if usable(on_path):
        return on_path
    venv_bin = Path(python).parent
    beside = shutil.which("quarto", path=str(venv_bin))
    if usable(beside):
        return beside
    found = "no quarto on PATH" if on_path is None else f"{on_path} is older than 1.9"
    print(f"{found}: installing {PINNED} into {venv_bin.parent}", file=sys.stderr)
    install = subprocess.run(
        [python, "-m", "pip", "install", "--quiet", PINNED],
        capture_output=True,
        text=True,
    )
    beside = shutil.which("quarto", path=str(venv_bin))
    if install.returncode != 0 or not usable(beside):
        raise RuntimeError(
            f"make book needs Quarto 1.9 or newer: {found}, and installing {PINNED} "
            "failed (its build downloads Quarto itself, so it needs internet). "
            "Install Quarto from https://quarto.org/docs/get-started/ and run "
            "make book again."
        )
    return beside


def main() -> int:
    try:
        print(find_quarto(sys.executable, os.environ.get("PATH")))
    except RuntimeError as error:
        print(error, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
