"""The code a chapter shows from the package stays the package's own text.

Quarto cannot include a range of lines from a file, so a chapter shows the key
lines of a module as a ```{.python filename="code/torchbook/<module>.py"}```
block. Each such block must be a run of consecutive lines of that module, as
written there (the block may be dedented as a whole); otherwise the page would
drift from the code that runs. A block whose body is Quarto's include shortcode
(the whole file) cannot drift and is left out.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHOWN_BLOCK = re.compile(
    r'^```\{\.python filename="(?P<path>[^"]+)"\}\n(?P<body>.*?)^```\s*$',
    re.DOTALL | re.MULTILINE,
)
INCLUDE = re.compile(r"^\{\{< include \S+ >\}\}$")
CHAPTERS = sorted((ROOT / "chapters").glob("*.qmd"))


def shown_blocks(chapter: Path) -> list[tuple[str, str]]:
    """(path, block text) for each filename= block of ``chapter``, includes excepted."""
    return [
        (match["path"], match["body"])
        for match in SHOWN_BLOCK.finditer(chapter.read_text(encoding="utf-8"))
        if not INCLUDE.match(match["body"].strip())
    ]


def is_verbatim_run(block: str, source: str) -> bool:
    """True if ``block`` equals a run of consecutive ``source`` lines, both dedented."""
    wanted = textwrap.dedent(block).rstrip("\n").splitlines()
    lines = source.splitlines()
    for start in range(len(lines) - len(wanted) + 1):
        if (
            textwrap.dedent("\n".join(lines[start : start + len(wanted)])).splitlines()
            == wanted
        ):
            return True
    return False


def test_an_include_shortcode_block_is_left_out(tmp_path):
    chapter = tmp_path / "chapter.qmd"
    chapter.write_text(
        '```{.python filename="code/x.py"}\n{{< include /code/x.py >}}\n```\n'
        '```{.python filename="code/y.py"}\nx = 1\n```\n',
        encoding="utf-8",
    )
    assert shown_blocks(chapter) == [("code/y.py", "x = 1\n")]


def test_a_dedented_run_is_found_and_a_changed_line_is_not():
    source = "def f():\n    a = 1\n    b = 2\n    return a + b\n"
    assert is_verbatim_run("a = 1\nb = 2\n", source)
    assert not is_verbatim_run("a = 1\nb = 3\n", source)
    assert not is_verbatim_run("a = 1\nreturn a + b\n", source)  # not consecutive


def test_chapter_3_shows_the_trainer_step():
    modules = {
        path for path, _ in shown_blocks(ROOT / "chapters" / "03-training-loop.qmd")
    }
    assert "code/torchbook/train.py" in modules


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda path: path.name)
def test_every_shown_block_is_a_run_of_its_module(chapter):
    stale = []
    for module, block in shown_blocks(chapter):
        path = ROOT / module
        if not path.is_file():
            stale.append(f"{module}: no such file")
        elif not is_verbatim_run(block, path.read_text(encoding="utf-8")):
            stale.append(f"{module}: block starting {block.splitlines()[0].strip()!r}")
    assert not stale, (
        f"{chapter.name} shows code that is not in the module as written: {stale}"
    )


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda path: path.name)
def test_every_shown_block_fits_the_page(chapter):
    # 88 columns, as ruff formats the package: a longer line wraps in the PDF.
    wide = [
        f"{module}: {line.strip()[:40]!r}"
        for module, block in shown_blocks(chapter)
        for line in block.splitlines()
        if len(line) > 88
    ]
    assert not wide, f"{chapter.name} shows code lines over 88 columns: {wide}"
