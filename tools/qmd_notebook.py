"""Convert a Quarto chapter (.qmd) into a Jupyter notebook, without Quarto.

The same converter serves two readers:

- the tests (``tests/chapter_harness.py``) run the notebook cell by cell under
  nbval. For them it also turns each inline value in the prose
  (`` `{python} expr` ``) into an extra code cell placed after the code cell
  it follows, and tags ``#| eval: false`` cells so nbval skips them;
- the book's readers download it: ``_quarto.yml`` runs this file as a
  post-render script, which writes ``<chapter>.ipynb`` beside each rendered
  chapter page. A reader's notebook opens with a setup cell that a fresh
  Jupyter or Colab kernel can run (it installs the book's package from a clone
  and says where the data goes), and shows each ``#| eval: false`` cell as a
  fenced block in a Markdown cell, so "Run All" never runs it.

Cell options (the leading ``#|`` lines of a cell) are parsed as YAML; a
malformed one raises ``QmdError`` naming the chapter and line.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
import yaml
from nbformat.v4 import new_code_cell, new_markdown_cell

EXECUTABLE_FENCE = re.compile(r"^(`{3,})\{python(?:[ ,][^}]*)?\}\s*$")
ANY_FENCE = re.compile(r"^(`{3,}|~{3,})")
INLINE_VALUE = re.compile(r"`\{python\}\s+([^`]+)`")
SKIP_TAG = "nbval-skip"
SETUP_TAG = "book-setup"  # metadata tag of the reader's setup cells

SETUP_MARKDOWN = """\
## Before you start: the book's package and its data

This notebook is a chapter of *PyTorch Essentials for LLM Work*. Its cells import
the book's package, `torchbook`, which lives in the book's repository. Get a
copy of the repository (a `git clone`, or its source archive unpacked), then
install it once into the environment of this kernel:

```bash
pip install -e path/to/your/copy     # installs torchbook and the pinned PyTorch
```

Or set `BOOK_CLONE` in the next cell to that folder and run the cell: it
installs the package if it is missing, then asks you to restart the kernel.

**Data.** MNIST and Tiny Shakespeare are downloaded on first use from their
published sources, and every file is checked against its SHA-256. They go to
`<clone>/.cache/data`, and everything derived from them (token shards,
tokenizers, checkpoints) to `<clone>/.cache`. To work offline, point
`BOOK_DATA_DIR` at a folder that already holds `MNIST/raw/*-ubyte` and
`tinyshakespeare/input.txt` (it is only read, never written); `BOOK_CACHE_DIR`
moves the derived files. Set both before the first `torchbook` import, as the
commented lines in the next cell show."""

SETUP_CODE = """\
# Setup for a fresh kernel: find (or install) the book's package, and say where the
# data goes.
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

# Your clone of the book's repository:
BOOK_CLONE = Path("~/pytorch-essentials").expanduser()
# Data already on disk (then nothing is downloaded), and where derived files go:
# os.environ["BOOK_DATA_DIR"] = "/path/to/data"
# os.environ["BOOK_CACHE_DIR"] = "/path/to/cache"

if importlib.util.find_spec("torchbook") is None:
    if not (BOOK_CLONE / "pyproject.toml").is_file():
        raise ModuleNotFoundError(
            f"torchbook is not installed, and {BOOK_CLONE} is not a clone of the "
            "book's repository: clone it, set BOOK_CLONE to its folder, and run this "
            "cell again."
        )
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "-e", str(BOOK_CLONE)],
        check=True,
    )
    raise SystemExit(
        "torchbook is installed now: restart the kernel "
        "and run the notebook from the top."
    )

import torchbook
from torchbook.book.download import cache_dir, data_dir

print(f"torchbook: {Path(torchbook.__file__).parent}")
print(f"data sets: {data_dir()}")
print(f"derived files: {cache_dir()}")"""

NOT_RUN_NOTE = (
    "*Shown, not run.* The book does not execute this cell "
    "(it is marked `#| eval: false`, for example because it needs "
    "the Hugging Face Hub and downloads a large data set). "
    "Copy it into a code cell to run it yourself."
)


class QmdError(ValueError):
    """A chapter cannot be converted; the message names the file and line."""


@dataclass
class Cell:
    kind: str  # "code" or "markdown"
    source: str
    line: int  # 1-based line of the cell's first line in the .qmd
    options: dict = field(default_factory=dict)


def _split_front_matter(lines: list[str], path: Path) -> tuple[dict, int]:
    """Return the YAML front matter and the index of the first line after it."""
    if not lines or lines[0].strip() != "---":
        return {}, 0
    for end in range(1, len(lines)):
        if lines[end].strip() in ("---", "..."):
            try:
                meta = yaml.safe_load("\n".join(lines[1:end])) or {}
            except yaml.YAMLError as error:
                raise QmdError(
                    f"{path}:1: front matter is not valid YAML: {error}"
                ) from error
            return meta, end + 1
    raise QmdError(f"{path}:1: front matter opened with '---' is never closed")


def _parse_options(body: list[str], first_line: int, path: Path) -> dict:
    """Parse the leading ``#|`` lines of a code cell as one YAML mapping."""
    option_lines = []
    for text in body:
        if not text.startswith("#|"):
            break
        option_lines.append(text[2:].removeprefix(" "))
    if not option_lines:
        return {}
    try:
        options = yaml.safe_load("\n".join(option_lines))
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        line = first_line + (mark.line if mark else 0)
        raise QmdError(
            f"{path}:{line}: cell option is not valid YAML: {error}"
        ) from error
    if not isinstance(options, dict):
        raise QmdError(
            f"{path}:{first_line}: cell options must be 'key: value' lines, "
            f"got {option_lines[0]!r}"
        )
    return options


def parse_qmd(path: Path) -> tuple[dict, list[Cell]]:
    """Split a .qmd file into its front matter and a list of markdown and code cells."""
    path = Path(path)
    lines = path.read_text(encoding="utf-8").splitlines()
    meta, index = _split_front_matter(lines, path)
    cells: list[Cell] = []
    markdown: list[str] = []
    markdown_start = index + 1

    def flush_markdown() -> None:
        leading_blank = next(
            (i for i, text in enumerate(markdown) if text.strip()), len(markdown)
        )
        text = "\n".join(markdown[leading_blank:]).rstrip("\n")
        if text.strip():
            cells.append(Cell("markdown", text, markdown_start + leading_blank))
        markdown.clear()

    while index < len(lines):
        text = lines[index]
        executable = EXECUTABLE_FENCE.match(text)
        other = ANY_FENCE.match(text)
        if executable or other:
            fence = (executable or other).group(1)
            closing = next(
                (
                    j
                    for j in range(index + 1, len(lines))
                    if lines[j].strip().startswith(fence[0] * len(fence))
                    and lines[j].strip().strip(fence[0]) == ""
                ),
                None,
            )
            if closing is None:
                raise QmdError(
                    f"{path}:{index + 1}: code fence {fence} is never closed"
                )
            if executable:
                flush_markdown()
                body = lines[index + 1 : closing]
                options = _parse_options(body, index + 2, path)
                cells.append(Cell("code", "\n".join(body), index + 2, options))
                markdown_start = closing + 2
            else:
                markdown.extend(lines[index : closing + 1])
            index = closing + 1
            continue
        markdown.append(text)
        index += 1
    flush_markdown()
    return meta, cells


def _inline_value_cell(cell: Cell) -> str | None:
    """Code evaluating each inline `` `{python} expr` `` of a markdown cell, or None."""
    found = [
        (cell.line + offset, expr.strip())
        for offset, text in enumerate(cell.source.splitlines())
        for expr in INLINE_VALUE.findall(text)
    ]
    if not found:
        return None
    lines = [f"# inline values from the prose at line {found[0][0]}"]
    lines += [f"print({expr})  # line {line}" for line, expr in found]
    return "\n".join(lines)


def _setup_cells() -> list[dict]:
    """The reader's opening cells: how to install the package, where the data goes."""
    metadata = {"tags": [SETUP_TAG]}
    return [
        new_markdown_cell(SETUP_MARKDOWN, metadata=dict(metadata)),
        new_code_cell(SETUP_CODE, metadata=dict(metadata)),
    ]


def new_notebook(cells: list[dict], title: str) -> nbformat.NotebookNode:
    """An nbformat-4 notebook of ``cells`` for a Python 3 kernel.

    Cells are numbered ``cell-0``, ``cell-1``, ... instead of nbformat's random
    ids, so that rendering the same chapter twice writes the same notebook.
    """
    for number, cell in enumerate(cells):
        cell["id"] = f"cell-{number}"
    kernelspec = {"name": "python3", "display_name": "Python 3", "language": "python"}
    metadata = {
        "title": title,
        "kernelspec": kernelspec,
        "language_info": {"name": "python"},
    }
    return nbformat.v4.new_notebook(cells=cells, metadata=metadata)


def save_notebook(notebook: nbformat.NotebookNode, target: Path) -> Path:
    """Write ``notebook`` to ``target``, creating its folder."""
    target.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(notebook, str(target))
    return target


def _not_run_cell(cell: Cell) -> dict:
    """A markdown cell with an ``eval: false`` cell's code, fenced, never run."""
    body = "\n".join(
        line for line in cell.source.splitlines() if not line.startswith("#|")
    )
    fence = "`" * max(
        3, 1 + max((len(run) for run in re.findall(r"`+", body)), default=0)
    )
    return new_markdown_cell(
        f"{NOT_RUN_NOTE}\n\n{fence}python\n{body.strip()}\n{fence}",
        metadata={"qmd_line": cell.line, "qmd_options": cell.options},
    )


INCLUDE = re.compile(r"^\{\{< include (\S+) >\}\}$", re.MULTILINE)


def _project_root(path: Path) -> Path:
    """The ``_quarto.yml`` folder above ``path``, where ``/`` include paths start."""
    for folder in path.resolve().parents:
        if (folder / "_quarto.yml").is_file():
            return folder
    return path.resolve().parent


def _expand_includes(cell: Cell, path: Path) -> str:
    """Markdown with each ``{{< include FILE >}}`` replaced by the file, as Quarto does.

    A notebook front end knows no shortcodes; a reader would otherwise see the
    shortcode instead of the code it stands for. A missing file fails here, as
    it would fail the render.
    """

    def included(match: re.Match) -> str:
        name = match.group(1)
        target = (
            _project_root(path) / name.lstrip("/")
            if name.startswith("/")
            else path.parent / name
        )
        if not target.is_file():
            raise QmdError(
                f"{path}:{cell.line}: include of {name}, and {target} does not exist"
            )
        return target.read_text(encoding="utf-8").rstrip("\n")

    return INCLUDE.sub(included, cell.source)


def to_notebook(path: Path, for_tests: bool = False) -> nbformat.NotebookNode:
    """Build an nbformat-4 notebook (as a dict) from a chapter.

    ``for_tests`` adds the inline-value cells and the nbval skip tags, and keeps
    ``eval: false`` cells as code for nbval to skip. Without it (the reader's
    notebook) the notebook opens with the setup cells and ``eval: false``
    cells become Markdown.
    """
    path = Path(path)
    meta, cells = parse_qmd(path)
    notebook_cells = [] if for_tests else _setup_cells()
    seen_code = False
    for cell in cells:
        metadata: dict = {"qmd_line": cell.line}
        if cell.kind == "markdown":
            notebook_cells.append(
                new_markdown_cell(_expand_includes(cell, path), metadata=metadata)
            )
            inline = _inline_value_cell(cell) if for_tests else None
            if inline is not None:
                if not seen_code:
                    raise QmdError(
                        f"{path}:{cell.line}: "
                        "inline `{python}` value before any code cell"
                    )
                notebook_cells.append(
                    new_code_cell(inline, metadata={"qmd_line": cell.line})
                )
            continue
        seen_code = True
        metadata["qmd_options"] = cell.options
        if cell.options.get("eval") is False:
            if not for_tests:
                notebook_cells.append(_not_run_cell(cell))
                continue
            metadata["tags"] = [SKIP_TAG]
        notebook_cells.append(new_code_cell(cell.source, metadata=metadata))
    return new_notebook(notebook_cells, meta.get("title", path.stem))


def write_notebook(path: Path, target: Path) -> Path:
    """Write the reader's notebook for chapter ``path`` to ``target``."""
    return save_notebook(to_notebook(path), target)


def write_book_notebooks(project: Path, output: Path) -> list[Path]:
    """Write ``<output>/chapters/NN-name.ipynb`` per chapter with code (post-render)."""
    written = []
    for chapter in sorted((project / "chapters").glob("*.qmd")):
        if any(cell.kind == "code" for cell in parse_qmd(chapter)[1]):
            written.append(
                write_notebook(chapter, output / "chapters" / f"{chapter.stem}.ipynb")
            )
    return written


if __name__ == "__main__":
    # Quarto runs post-render scripts from the project root with these variables set.
    project_root = Path(os.environ.get("QUARTO_PROJECT_DIR", ".")).resolve()
    output_dir = Path(os.environ.get("QUARTO_PROJECT_OUTPUT_DIR", "_book"))
    if not output_dir.is_absolute():
        output_dir = project_root / output_dir
    for written_path in write_book_notebooks(project_root, output_dir):
        print(f"notebook: {written_path.relative_to(project_root)}", file=sys.stderr)
