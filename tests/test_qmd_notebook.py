"""The .qmd -> notebook converter that both the tests and the notebook downloads use."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from qmd_notebook import (  # noqa: E402
    NOT_RUN_NOTE,
    SETUP_CODE,
    SETUP_TAG,
    QmdError,
    to_notebook,
    write_book_notebooks,
    write_notebook,
)


def write(tmp_path: Path, text: str, name: str = "chapter.qmd") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).lstrip(), encoding="utf-8")
    return path


def chapter_cells(notebook: dict) -> list[dict]:
    """The cells that come from the chapter, without the reader's setup cells."""
    return [
        cell
        for cell in notebook["cells"]
        if SETUP_TAG not in cell["metadata"].get("tags", [])
    ]


def code_sources(notebook: dict) -> list[str]:
    return [
        cell["source"]
        for cell in chapter_cells(notebook)
        if cell["cell_type"] == "code"
    ]


def test_python_cells_become_code_and_prose_becomes_markdown(tmp_path):
    path = write(
        tmp_path,
        """
        ---
        title: "T"
        ---
        Intro.

        ```{python}
        x = 1
        ```

        Outro.
        """,
    )
    notebook = to_notebook(path)
    kinds = [cell["cell_type"] for cell in chapter_cells(notebook)]
    assert kinds == ["markdown", "code", "markdown"]
    assert code_sources(notebook) == ["x = 1"]
    assert notebook["metadata"]["title"] == "T"


def test_fenced_examples_in_prose_are_not_executed(tmp_path):
    path = write(
        tmp_path,
        """
        Show a cell without running it:

        ````markdown
        ```{python}
        raise SystemExit
        ```
        ````

        ```python
        also_not_run()
        ```
        """,
    )
    assert code_sources(to_notebook(path)) == []


def test_eval_false_cells_are_tagged_for_nbval_to_skip(tmp_path):
    path = write(
        tmp_path,
        """
        ```{python}
        #| eval: false
        load_dataset("a/hub/name")
        ```
        """,
    )
    (cell,) = [
        c
        for c in to_notebook(path, for_tests=True)["cells"]
        if c["cell_type"] == "code"
    ]
    assert cell["metadata"]["tags"] == ["nbval-skip"]
    assert cell["metadata"]["qmd_options"] == {"eval": False}


def test_inline_values_run_after_the_cell_they_follow(tmp_path):
    path = write(
        tmp_path,
        """
        ```{python}
        a = 2
        ```

        Two values: `{python} a + 1` and `{python} f"{a:.1f}"`.

        ```{python}
        b = 3
        ```
        """,
    )
    sources = code_sources(to_notebook(path, for_tests=True))
    assert sources[0] == "a = 2"
    assert (
        "print(a + 1)  # line 5" in sources[1]
        and 'print(f"{a:.1f}")  # line 5' in sources[1]
    )
    assert sources[2] == "b = 3"
    # Readers' notebooks keep the prose as written, without the extra cells.
    assert code_sources(to_notebook(path)) == ["a = 2", "b = 3"]


def test_malformed_cell_option_names_the_chapter_and_line(tmp_path):
    path = write(
        tmp_path,
        """
        Text.

        ```{python}
        #| label: fig-ok
        #| fig-cap: "unclosed
        x = 1
        ```
        """,
    )
    with pytest.raises(
        QmdError, match=r"chapter\.qmd:\d+: cell option is not valid YAML"
    ):
        to_notebook(path)


def test_options_that_are_not_a_mapping_are_refused(tmp_path):
    path = write(
        tmp_path,
        """
        ```{python}
        #| just some words
        x = 1
        ```
        """,
    )
    with pytest.raises(
        QmdError, match=r"chapter\.qmd:2: cell options must be 'key: value' lines"
    ):
        to_notebook(path)


def test_unclosed_fence_is_refused_with_its_line(tmp_path):
    path = write(
        tmp_path,
        """
        Text.

        ```{python}
        x = 1
        """,
    )
    with pytest.raises(
        QmdError, match=r"chapter\.qmd:3: code fence ``` is never closed"
    ):
        to_notebook(path)


def test_book_notebooks_are_written_for_chapters_with_code(tmp_path):
    chapters = tmp_path / "chapters"
    chapters.mkdir()
    write(chapters, "```{python}\nx = 1\n```\n", "01-a.qmd")
    write(chapters, "Prose only.\n", "02-b.qmd")
    written = write_book_notebooks(tmp_path, tmp_path / "_book")
    assert [path.name for path in written] == ["01-a.ipynb"]
    assert (tmp_path / "_book" / "chapters" / "01-a.ipynb").is_file()


def test_reader_notebook_opens_with_setup_cells_and_tests_do_not(tmp_path):
    path = write(tmp_path, "```{python}\nx = 1\n```\n")
    first, second = to_notebook(path)["cells"][:2]
    assert first["cell_type"] == "markdown" and second["cell_type"] == "code"
    assert (
        SETUP_TAG in first["metadata"]["tags"]
        and SETUP_TAG in second["metadata"]["tags"]
    )
    assert "pip install -e" in first["source"] and "BOOK_DATA_DIR" in first["source"]
    assert "SHA-256" in first["source"], (
        "the reader must learn that downloads are checked"
    )
    compile(second["source"], "setup", "exec")  # the setup cell is valid Python
    tested = to_notebook(path, for_tests=True)["cells"]
    assert not any(SETUP_TAG in cell["metadata"].get("tags", []) for cell in tested)


def test_eval_false_cell_is_markdown_in_the_reader_notebook(tmp_path):
    path = write(
        tmp_path,
        """
        ```{python}
        #| eval: false
        load_dataset("HuggingFaceH4/ultrachat_200k")
        ```

        ```{python}
        y = 2
        ```
        """,
    )
    cells = chapter_cells(to_notebook(path))
    assert code_sources(to_notebook(path)) == ["y = 2"], (
        "no code cell may hold the eval: false code"
    )
    shown = cells[0]
    assert shown["cell_type"] == "markdown"
    assert shown["source"].startswith(NOT_RUN_NOTE)
    assert (
        '```python\nload_dataset("HuggingFaceH4/ultrachat_200k")\n```'
        in shown["source"]
    )
    assert "#|" not in shown["source"].split("```python", 1)[1], (
        "the cell options are Quarto's, not the reader's"
    )


def test_not_run_block_uses_a_longer_fence_than_its_code(tmp_path):
    path = write(
        tmp_path,
        """
        ````{python}
        #| eval: false
        text = \"\"\"```inner```\"\"\"
        ````
        """,
    )
    (shown,) = chapter_cells(to_notebook(path))
    assert "````python\n" in shown["source"] and shown["source"].endswith("\n````")


def run_setup_code(tmp_path: Path, *python_flags: str) -> subprocess.CompletedProcess:
    environment = {
        **os.environ,
        "HOME": str(tmp_path),
        "BOOK_CACHE_DIR": str(tmp_path / "cache"),
    }
    return subprocess.run(
        [sys.executable, *python_flags, "-c", SETUP_CODE],
        cwd=tmp_path,
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_setup_cell_finds_the_package_and_names_the_data_folders(tmp_path):
    result = run_setup_code(tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"torchbook: {ROOT / 'code' / 'torchbook'}" in result.stdout
    assert f"derived files: {tmp_path / 'cache'}" in result.stdout
    assert "data sets: " in result.stdout


def test_setup_cell_without_the_package_says_how_to_install_it(tmp_path):
    # -S -I: no site-packages, so torchbook cannot be found, as in a fresh Colab kernel.
    result = run_setup_code(tmp_path, "-S", "-I")
    assert result.returncode != 0
    assert (
        "ModuleNotFoundError" in result.stderr
        and "is not a clone of the book's repository" in result.stderr
    )


@pytest.mark.slow
def test_downloaded_chapter_runs_outside_the_repository_in_a_fresh_kernel(
    tmp_path, monkeypatch
):
    """Chapter 1 (the fastest) as a reader runs it: the .ipynb, in a folder alone."""
    # the kernel inherits it
    monkeypatch.setenv("BOOK_CACHE_DIR", str(tmp_path / "cache"))
    nbclient = pytest.importorskip("nbclient")
    nbformat = pytest.importorskip("nbformat")
    notebook_path = write_notebook(
        ROOT / "chapters" / "01-tensors.qmd", tmp_path / "01-tensors.ipynb"
    )
    notebook = nbformat.read(notebook_path, as_version=4)
    client = nbclient.NotebookClient(
        notebook,
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()  # raises CellExecutionError naming the cell if any cell fails
    setup_output = "".join(
        output.get("text", "") for output in notebook.cells[1].outputs
    )
    assert f"torchbook: {ROOT / 'code' / 'torchbook'}" in setup_output, setup_output
    assert f"derived files: {tmp_path / 'cache'}" in setup_output, setup_output
    ran = [
        cell
        for cell in notebook.cells
        if cell.cell_type == "code" and cell.execution_count
    ]
    assert len(ran) == sum(cell.cell_type == "code" for cell in notebook.cells), (
        "every code cell must run"
    )


def test_an_include_shortcode_becomes_the_file_it_names(tmp_path):
    (tmp_path / "_quarto.yml").write_text("project:\n  type: book\n")
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "shown.py").write_text("def shown():\n    return 1\n")
    chapter = tmp_path / "chapters" / "c.qmd"
    chapter.parent.mkdir()
    chapter.write_text(
        '---\ntitle: t\n---\n\n```{.python filename="code/shown.py"}\n'
        "{{< include /code/shown.py >}}\n```\n\n```{python}\nx = 1\n```\n"
    )
    markdown = [
        cell["source"]
        for cell in to_notebook(chapter)["cells"]
        if cell["cell_type"] == "markdown"
    ]
    assert any(
        "def shown():\n    return 1" in text and "include" not in text
        for text in markdown
    )


def test_an_include_of_a_missing_file_names_the_chapter_and_line(tmp_path):
    (tmp_path / "_quarto.yml").write_text("project:\n  type: book\n")
    chapter = tmp_path / "c.qmd"
    chapter.write_text(
        "---\ntitle: t\n---\n\n```python\n{{< include /code/gone.py >}}\n```\n"
    )
    with pytest.raises(QmdError, match=r"c.qmd:5: include of /code/gone.py"):
        to_notebook(chapter)
