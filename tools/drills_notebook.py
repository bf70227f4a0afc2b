"""Write the lab's exercise notebook ``pytorch_drills.ipynb`` from its Markdown source.

The source, ``exercises/pytorch_drills.md``, is plain Markdown: each fenced
````python`` block becomes a code cell, the text between blocks a Markdown cell.
The notebook opens with the same setup cells as every chapter's notebook
(``tools/qmd_notebook.py``: install the book's package, say where the data goes).
Each drill is a task, what to leave behind, a ``# TODO`` cell and a
``check(N, globals())`` cell.

The source is refused, naming the line, if it holds what a notebook cannot
show or must not give away: Quarto syntax (inline ``{python}`` values,
``:::`` divs, ``@sec-`` references, ``{#sec-`` anchors) or an import of
``torchbook.book.lab``, where the chapter's shared code lives; and if a drill lacks
its TODO or its check cell.

Usage, from the project root (Quarto runs it as a pre-render script, so the
file exists when the chapter's link to it is resolved and Quarto copies it
beside the page)::

    python tools/drills_notebook.py [NOTEBOOK]

``NOTEBOOK`` defaults to ``chapters/pytorch_drills.ipynb`` (git-ignored).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nbformat.v4 import new_code_cell, new_markdown_cell  # noqa: E402
from qmd_notebook import (  # noqa: E402
    SETUP_CODE,
    SETUP_MARKDOWN,
    SETUP_TAG,
    QmdError,
    new_notebook,
    save_notebook,
)

SOURCE = Path("exercises/pytorch_drills.md")
DEFAULT_TARGET = Path("chapters/pytorch_drills.ipynb")
DRILLS = range(1, 8)
CODE_FENCE = re.compile(r"^```python\s*$")
CHECK_CALL = re.compile(r"^check\((\d+), globals\(\)\)$")
TODO_CELL = re.compile(r"^# TODO: drill (\d+)$")
FORBIDDEN = {
    "{python}": "an inline Quarto value",
    ":::": "a Quarto div",
    "@sec-": "a Quarto cross-reference",
    "{#sec-": "a Quarto section anchor",
    "torchbook.book.lab": "an import of the chapter's lab code",
}


def parse_cells(path: Path) -> list[tuple[str, str, int]]:
    """(kind, source, first line) per Markdown cell; refuses forbidden text by line."""
    lines = path.read_text(encoding="utf-8").splitlines()
    for number, text in enumerate(lines, 1):
        for pattern, what in FORBIDDEN.items():
            if pattern in text:
                raise QmdError(
                    f"{path}:{number}: {what} ({pattern!r}) "
                    "has no place in the exercise notebook"
                )
    cells: list[tuple[str, str, int]] = []
    block: list[str] = []
    start, in_code = 1, False
    for number, text in enumerate(lines, 1):
        if CODE_FENCE.match(text) and not in_code or text.strip() == "```" and in_code:
            source = "\n".join(block).strip("\n")
            if source.strip():
                cells.append(("code" if in_code else "markdown", source, start))
            block, start, in_code = [], number + 1, not in_code
        else:
            block.append(text)
    if in_code:
        raise QmdError(f"{path}:{start - 1}: code block is never closed")
    if "\n".join(block).strip():
        cells.append(("markdown", "\n".join(block).strip("\n"), start))
    return cells


def check_drills(cells: list[tuple[str, str, int]], path: Path) -> None:
    """Each drill in order: a ``# TODO: drill N`` cell, then ``check(N, globals())``."""
    code = [(source.strip(), line) for kind, source, line in cells if kind == "code"]
    found = []
    followed_by = code[1:] + [("", 0)]
    for (source, line), (following, _) in zip(code, followed_by, strict=False):
        todo = TODO_CELL.match(source)
        if todo:
            checked = CHECK_CALL.match(following)
            if not checked or checked.group(1) != todo.group(1):
                raise QmdError(
                    f"{path}:{line}: the TODO of drill {todo.group(1)} "
                    f"is not followed by check({todo.group(1)}, globals())"
                )
            found.append(int(todo.group(1)))
    if found != list(DRILLS):
        raise QmdError(
            f"{path}: TODO cells for drills {found}; expected {list(DRILLS)}, in order"
        )


def exercise_notebook(source: Path) -> dict:
    """The exercise notebook (nbformat 4, as a dict) built from ``source``."""
    cells = parse_cells(source)
    check_drills(cells, source)
    setup = {"tags": [SETUP_TAG]}
    notebook_cells = [
        new_markdown_cell(SETUP_MARKDOWN, metadata=dict(setup)),
        new_code_cell(SETUP_CODE, metadata=dict(setup)),
    ]
    for kind, text, line in cells:
        new_cell = new_code_cell if kind == "code" else new_markdown_cell
        notebook_cells.append(new_cell(text, metadata={"source_line": line}))
    return new_notebook(notebook_cells, "pytorch_drills: the lab's exercises")


def write_exercise_notebook(project: Path, target: Path) -> Path:
    """Write the notebook built from ``project``'s exercise source to ``target``."""
    return save_notebook(exercise_notebook(project / SOURCE), target)


if __name__ == "__main__":
    project_root = Path(os.environ.get("QUARTO_PROJECT_DIR", ".")).resolve()
    target_path = (
        Path(sys.argv[1]) if len(sys.argv) > 1 else project_root / DEFAULT_TARGET
    )
    written = write_exercise_notebook(project_root, target_path)
    print(f"exercise notebook: {written}", file=sys.stderr)
