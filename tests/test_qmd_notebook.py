"""The .qmd -> notebook converter that both the tests and the notebook downloads use."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from qmd_notebook import QmdError, to_notebook, write_book_notebooks  # noqa: E402


def write(tmp_path: Path, text: str, name: str = "chapter.qmd") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).lstrip(), encoding="utf-8")
    return path


def code_sources(notebook: dict) -> list[str]:
    return [cell["source"] for cell in notebook["cells"] if cell["cell_type"] == "code"]


def test_python_cells_become_code_and_prose_becomes_markdown(tmp_path):
    path = write(tmp_path, """
        ---
        title: "T"
        ---
        Intro.

        ```{python}
        x = 1
        ```

        Outro.
        """)
    notebook = to_notebook(path)
    kinds = [cell["cell_type"] for cell in notebook["cells"]]
    assert kinds == ["markdown", "code", "markdown"]
    assert code_sources(notebook) == ["x = 1"]
    assert notebook["metadata"]["title"] == "T"


def test_fenced_examples_in_prose_are_not_executed(tmp_path):
    path = write(tmp_path, """
        Show a cell without running it:

        ````markdown
        ```{python}
        raise SystemExit
        ```
        ````

        ```python
        also_not_run()
        ```
        """)
    assert code_sources(to_notebook(path)) == []


def test_eval_false_cells_are_tagged_for_nbval_to_skip(tmp_path):
    path = write(tmp_path, """
        ```{python}
        #| eval: false
        load_dataset("a/hub/name")
        ```
        """)
    (cell,) = [c for c in to_notebook(path, for_tests=True)["cells"] if c["cell_type"] == "code"]
    assert cell["metadata"]["tags"] == ["nbval-skip"]
    assert cell["metadata"]["qmd_options"] == {"eval": False}


def test_inline_values_run_after_the_cell_they_follow(tmp_path):
    path = write(tmp_path, """
        ```{python}
        a = 2
        ```

        Two values: `{python} a + 1` and `{python} f"{a:.1f}"`.

        ```{python}
        b = 3
        ```
        """)
    sources = code_sources(to_notebook(path, for_tests=True))
    assert sources[0] == "a = 2"
    assert "print(a + 1)  # line 5" in sources[1] and "print(f\"{a:.1f}\")  # line 5" in sources[1]
    assert sources[2] == "b = 3"
    # Readers' notebooks keep the prose as written, without the extra cells.
    assert code_sources(to_notebook(path)) == ["a = 2", "b = 3"]


def test_malformed_cell_option_names_the_chapter_and_line(tmp_path):
    path = write(tmp_path, """
        Text.

        ```{python}
        #| label: fig-ok
        #| fig-cap: "unclosed
        x = 1
        ```
        """)
    with pytest.raises(QmdError, match=r"chapter\.qmd:\d+: cell option is not valid YAML"):
        to_notebook(path)


def test_options_that_are_not_a_mapping_are_refused(tmp_path):
    path = write(tmp_path, """
        ```{python}
        #| just some words
        x = 1
        ```
        """)
    with pytest.raises(QmdError, match=r"chapter\.qmd:2: cell options must be 'key: value' lines"):
        to_notebook(path)


def test_unclosed_fence_is_refused_with_its_line(tmp_path):
    path = write(tmp_path, """
        Text.

        ```{python}
        x = 1
        """)
    with pytest.raises(QmdError, match=r"chapter\.qmd:3: code fence ``` is never closed"):
        to_notebook(path)


def test_book_notebooks_are_written_for_chapters_with_code(tmp_path):
    chapters = tmp_path / "chapters"
    chapters.mkdir()
    write(chapters, "```{python}\nx = 1\n```\n", "01-a.qmd")
    write(chapters, "Prose only.\n", "02-b.qmd")
    written = write_book_notebooks(tmp_path, tmp_path / "_book")
    assert [path.name for path in written] == ["01-a.ipynb"]
    assert (tmp_path / "_book" / "chapters" / "01-a.ipynb").is_file()
