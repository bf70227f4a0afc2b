"""Write the lab's exercise notebook, ``pytorch_drills.ipynb``, from chapter 7 itself.

The notebook is the chapter's reader notebook (``tools/qmd_notebook.py``) with
each drill's solution cell (a code cell labelled ``solution-drill-N``)
replaced by a ``# TODO`` cell. The TODO cell keeps the solution's leading
comment lines, which say what the drill asks and which names the check cell
after it (``check-drill-N``, calling ``torchbook.drills.check_drill_N``) needs.
Being generated from the chapter, the exercises never drift from the solved
drills; filled in with the solutions, the notebook is the chapter again.

Usage (the post-render step, from the project root)::

    python tools/drills_notebook.py [OUTPUT_DIR]

writes ``OUTPUT_DIR/chapters/pytorch_drills.ipynb`` beside ``08-lab.html``
(``OUTPUT_DIR`` defaults to ``$QUARTO_PROJECT_OUTPUT_DIR`` or ``_book``).
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from qmd_notebook import QmdError, to_notebook  # noqa: E402

LAB_CHAPTER = Path("chapters/08-lab.qmd")
NOTEBOOK_NAME = "pytorch_drills.ipynb"
SOLUTION_LABEL = re.compile(r"^solution-drill-(\d+)$")
CHECK_LABEL = re.compile(r"^check-drill-(\d+)$")


def _label(cell: dict) -> str:
    return str(cell.get("metadata", {}).get("qmd_options", {}).get("label", ""))


def todo_source(solution: str) -> str:
    """The TODO cell for a solution: its leading comment lines (the task), then ``# TODO``."""
    task = []
    for line in solution.splitlines():
        if line.startswith("#|"):
            continue
        if not line.startswith("#"):
            break
        task.append(line)
    return "\n".join(task + ["# TODO: your code here"])


def exercise_notebook(chapter: Path) -> dict:
    """The exercise notebook for ``chapter``; refuses a chapter whose drills lack a solution or a check."""
    notebook = to_notebook(chapter)
    solutions: list[int] = []
    checks: list[int] = []
    for cell in notebook["cells"]:
        solution = SOLUTION_LABEL.match(_label(cell))
        check = CHECK_LABEL.match(_label(cell))
        if solution:
            number = int(solution.group(1))
            if not todo_source(cell["source"]).startswith("#"):
                raise QmdError(f"{chapter}:{cell['metadata']['qmd_line']}: solution of drill {number} "
                               "starts with no comment saying what the drill asks")
            cell["metadata"]["drill_solution"] = number
            cell["source"] = todo_source(cell["source"])
            solutions.append(number)
        elif check:
            checks.append(int(check.group(1)))
    if not solutions or solutions != checks:
        raise QmdError(f"{chapter}: solution cells for drills {solutions} but check cells for {checks}; "
                       "every drill needs one of each, in the same order")
    notebook["metadata"]["title"] = "pytorch_drills: the lab's exercises"
    return notebook


def write_exercise_notebook(project: Path, output: Path) -> Path:
    """Write ``<output>/chapters/pytorch_drills.ipynb`` for the lab chapter of ``project``."""
    target = output / "chapters" / NOTEBOOK_NAME
    target.parent.mkdir(parents=True, exist_ok=True)
    notebook = exercise_notebook(project / LAB_CHAPTER)
    target.write_text(json.dumps(notebook, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return target


if __name__ == "__main__":
    project_root = Path(os.environ.get("QUARTO_PROJECT_DIR", ".")).resolve()
    default_output = os.environ.get("QUARTO_PROJECT_OUTPUT_DIR", "_book")
    output_dir = Path(sys.argv[1] if len(sys.argv) > 1 else default_output)
    if not output_dir.is_absolute():
        output_dir = project_root / output_dir
    written = write_exercise_notebook(project_root, output_dir)
    print(f"notebook: {written.relative_to(project_root) if written.is_relative_to(project_root) else written}",
          file=sys.stderr)
