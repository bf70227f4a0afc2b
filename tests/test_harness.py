"""The chapter harness must be able to fail: broken chapters run in another pytest."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_chapter(tmp_path: Path, text: str, *extra: str) -> subprocess.CompletedProcess:
    """Run pytest with only the chapter harness on one chapter written to tmp_path."""
    chapter = tmp_path / "broken.qmd"
    chapter.write_text(textwrap.dedent(text).lstrip(), encoding="utf-8")
    (tmp_path / "pytest.ini").write_text("[pytest]\n", encoding="utf-8")
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "tests.chapter_harness",
        "-p",
        "no:cacheprovider",
        "-c",
        str(tmp_path / "pytest.ini"),
        str(chapter),
        *extra,
    ]
    return subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=120
    )


@pytest.mark.slow
def test_failing_cell_reports_chapter_line_first_line_and_error(tmp_path):
    result = run_chapter(
        tmp_path,
        """
        ---
        title: "Broken"
        ---

        ```{python}
        values = [1, 2, 3]
        ```

        ```{python}
        total = sum(values)
        assert total == 7, f"total is {total}, expected 7"
        ```
        """,
    )
    assert result.returncode == 1, result.stdout
    assert "broken.qmd:10: cell `total = sum(values)` failed" in result.stdout
    assert (
        "AssertionError" in result.stdout and "total is 6, expected 7" in result.stdout
    )
    assert "1 failed, 1 passed" in result.stdout


@pytest.mark.slow
def test_inline_value_typo_fails_like_a_cell(tmp_path):
    result = run_chapter(
        tmp_path,
        """
        ```{python}
        accuracy = 0.98
        ```

        The accuracy is `{python} f"{acuracy:.1%}"`.
        """,
    )
    assert result.returncode == 1, result.stdout
    assert "inline values from the prose at line 5" in result.stdout
    assert "NameError" in result.stdout


@pytest.mark.slow
def test_eval_false_cell_is_skipped(tmp_path):
    result = run_chapter(
        tmp_path,
        """
        ```{python}
        #| eval: false
        raise RuntimeError("must not run")
        ```

        ```{python}
        x = 1
        ```
        """,
    )
    assert result.returncode == 0, result.stdout
    assert "1 passed, 1 skipped" in result.stdout


@pytest.mark.slow
def test_unexpected_warning_fails_the_cell(tmp_path):
    result = run_chapter(
        tmp_path,
        """
        ```{python}
        import warnings
        warnings.warn("something the reader should not see")
        ```

        ```{python}
        #| warning: false
        import warnings
        warnings.warn("hidden on the page, so allowed")
        ```
        """,
    )
    assert result.returncode == 1, result.stdout
    assert "printed a warning the chapter does not mean to show" in result.stdout
    assert "1 failed, 1 passed" in result.stdout


@pytest.mark.slow
def test_chapter_over_its_budget_fails(tmp_path):
    result = run_chapter(
        tmp_path,
        """
        ```{python}
        import time
        time.sleep(30)
        ```

        ```{python}
        x = 1
        ```
        """,
        "--chapter-budget",
        "8",
    )
    assert result.returncode == 1, result.stdout
    assert "ran past its limit of 8 s for the whole chapter" in result.stdout


@pytest.mark.slow
def test_malformed_option_fails_collection_naming_chapter_and_line(tmp_path):
    result = run_chapter(
        tmp_path,
        """
        ```{python}
        #| fig-cap: "unclosed
        x = 1
        ```
        """,
    )
    assert result.returncode != 0
    assert "broken.qmd:2: cell option is not valid YAML" in result.stdout


@pytest.mark.slow
def test_prose_only_page_is_collected_as_a_parse_check(tmp_path):
    # The References page has no code; naming it in testpaths must not be "not found".
    result = run_chapter(
        tmp_path,
        """
        # References {.unnumbered}

        ::: {#refs}
        :::
        """,
    )
    assert result.returncode == 0, result.stdout
    assert "1 passed" in result.stdout


@pytest.mark.slow
def test_a_chapter_that_starts_workers_runs_a_second_time_under_spawn(tmp_path):
    # The default start method on Linux is fork; the second run's first cell sets spawn,
    # so this assert fails there.
    result = run_chapter(
        tmp_path,
        """
        ```{python}
        import multiprocessing
        ```

        ```{python}
        method = multiprocessing.get_start_method()
        assert method != "spawn", f"this run uses {method}"
        ```
        """,
    )
    assert result.returncode == 1, result.stdout
    assert "spawn: line 6: method = multiprocessing.get_start_method()" in result.stdout
    assert "this run uses spawn" in result.stdout
    # 2 cells by default; the start-method cell and 2 cells under spawn
    assert "1 failed, 4 passed" in result.stdout


@pytest.mark.slow
def test_a_notebook_class_sent_to_dataloader_workers_fails_only_under_spawn(tmp_path):
    # What readers on macOS and Windows meet: fork copies the class into the worker,
    # spawn must import it.
    result = run_chapter(
        tmp_path,
        """
        ```{python}
        import torch
        from torch.utils.data import DataLoader, Dataset


        class Squares(Dataset):
            def __len__(self):
                return 4

            def __getitem__(self, i):
                return torch.tensor(i * i)


        loader = DataLoader(Squares(), batch_size=None, num_workers=1)
        assert [int(x) for x in loader] == [0, 1, 4, 9]
        ```
        """,
    )
    assert result.returncode == 1, result.stdout
    assert (
        "broken.qmd:2: cell `import torch` failed under the spawn start method"
        in result.stdout
    )
    # the default run, then the start-method cell and the failure
    assert "1 failed, 2 passed" in result.stdout


@pytest.mark.slow
def test_a_chapter_without_workers_runs_once(tmp_path):
    result = run_chapter(
        tmp_path,
        """
        ```{python}
        from torch.utils.data import DataLoader
        loader = DataLoader(range(4), num_workers=0)
        ```
        """,
    )
    assert result.returncode == 0, result.stdout
    assert "1 passed" in result.stdout and "spawn" not in result.stdout


@pytest.mark.slow
def test_a_figure_cell_that_draws_nothing_fails(tmp_path):
    result = run_chapter(
        tmp_path,
        """
        ```{python}
        #| label: fig-drawn
        #| fig-cap: "A line."
        import matplotlib.pyplot as plt
        plt.plot([1, 2])
        plt.show()
        ```

        ```{python}
        #| label: fig-empty
        #| fig-cap: "Nothing is drawn."
        x = 1
        ```
        """,
    )
    assert result.returncode == 1, result.stdout
    assert "labelled 'fig-empty' but produced no image" in result.stdout
    assert "1 failed, 1 passed" in result.stdout


@pytest.mark.slow
def test_chapter_times_are_cpu_seconds_and_reach_the_summary_under_xdist(tmp_path):
    # A sleeping cell costs wall time but no CPU time: judged by CPU time, as if the
    # chapter ran alone, a chapter that waits is not charged for the wait, and one
    # that computes is. Two xdist workers: the times travel back to the main process.
    result = run_chapter(
        tmp_path,
        """
        ```{python}
        import time
        time.sleep(3)
        ```

        ```{python}
        spent = time.process_time()
        while time.process_time() - spent < 1.0:
            pass
        ```
        """,
        "-n",
        "2",
    )
    assert result.returncode == 0, result.stdout
    line = next(
        (text for text in result.stdout.splitlines() if text.startswith("broken.qmd:")),
        None,
    )
    assert line is not None, f"no chapter time in the summary:\n{result.stdout}"
    cpu_s = float(line.split(":")[1].split("s CPU")[0])
    wall_s = float(line.split("CPU,")[1].split("s wall")[0])
    # at least the second cell's second of CPU; far less than the sleep's 3 s of wall
    assert 1.0 <= cpu_s < 3.0, line
    assert wall_s >= 3.0, line
