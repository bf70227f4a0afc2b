"""Run each chapter (.qmd) cell by cell under nbval, in a fresh kernel, without Quarto.

What it adds to nbval:

- it converts the .qmd itself (tools/qmd_notebook.py), including one extra cell
  per block of inline `` `{python} expr` `` values, so a typo there fails here
  and not first at render time;
- the kernel is this interpreter's (the ``.venv``), started in ``chapters/``
  as Quarto does, with a fresh, empty ``torch.compile`` cache and an empty folder
  for derived files (``BOOK_CACHE_DIR``), as on a fresh clone;
- each chapter's time judged as if it ran alone: the CPU seconds of its kernel and
  of the processes the kernel started and waited for, so that chapters running side
  by side under pytest-xdist do not push each other over their budgets; the wall
  clock only guards against a hang (a limit of several budgets);
- a failure names the chapter, the cell's line and first line, and the error;
- a cell that prints a warning fails unless it opts in with ``#| warning: true``
  (or hides warnings with ``#| warning: false``), so no rendered page shows a
  warning the chapter did not mean to show;
- a cell labelled ``fig-...`` fails unless it produces an image, so a figure
  that stops being drawn is caught here, not by a reader;
- a chapter whose code starts worker processes (``num_workers=`` other than 0,
  or ``multiprocessing``) is collected a second time and run with the ``spawn``
  start method, as on macOS and Windows, where a class defined in a notebook
  cell cannot reach a worker. Its items are named ``spawn: line N: ...``.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import psutil
import pytest
from nbformat import from_dict
from nbval.kernel import CURRENT_ENV_KERNEL_NAME, RunningKernel
from nbval.plugin import IPyNbCell, IPyNbFile, NbCellError, find_metadata_tags

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from qmd_notebook import QmdError, parse_qmd, to_notebook  # noqa: E402

from torchbook.book.download import CACHE_VARIABLE, DATA_VARIABLE, data_dir  # noqa: E402

# Budgets from the book's design, on 2 CPU cores without native bf16 (or under the
# emulation conftest.py sets up) with a cold torch.compile cache, judged by CPU time
# (torch runs one thread per process in the tests, so alone a chapter's CPU time is
# about its wall time). The summary marks a chapter over its budget; a timing is
# reported, never asserted. The wall clock fails a chapter only past LIMIT_FACTOR
# times its budget: a hung cell, not a slow machine.
CHAPTER_BUDGET_S = 45.0
LAB_BUDGET_S = 90.0
LIMIT_FACTOR = 4.0
KERNEL_STARTUP_TIMEOUT_S = 60
COMPILE_CACHE_VARIABLE = "TORCHINDUCTOR_CACHE_DIR"
CHAPTER_ENV = (COMPILE_CACHE_VARIABLE, CACHE_VARIABLE, DATA_VARIABLE)
WARNING_MARKERS = ("Warning:", "UserWarning", "FutureWarning", "DeprecationWarning")
# Code that starts worker processes: DataLoader workers (num_workers other than 0) or
# multiprocessing itself.
STARTS_WORKERS = re.compile(r"\bnum_workers\s*=\s*(?!0\b)|\bmultiprocessing\b")
START_METHOD_CELL = (
    "import multiprocessing\n\nmultiprocessing.set_start_method({!r}, force=True)"
)


def pytest_addoption(parser):
    parser.addoption(
        "--chapter-budget",
        type=float,
        default=None,
        metavar="SECONDS",
        help=(
            "override every chapter's time limit "
            "(the harness's own tests use a tiny one)"
        ),
    )


def chapter_budget_s(name: str) -> float:
    """Seconds the design gives the whole chapter: the lab gets more."""
    return LAB_BUDGET_S if "lab" in name else CHAPTER_BUDGET_S


def chapter_limit_s(path: Path, override: float | None = None) -> float:
    """Wall seconds after which the chapter fails: a hang, or ``override``."""
    if override is not None:
        return override
    return LIMIT_FACTOR * chapter_budget_s(path.stem)


def has_code(path: Path) -> bool:
    try:
        return any(cell.kind == "code" for cell in parse_qmd(path)[1])
    except QmdError:
        return True  # let collection report the error


def starts_workers(path: Path) -> bool:
    """True when a code cell that runs starts worker processes (see STARTS_WORKERS)."""
    try:
        cells = parse_qmd(path)[1]
    except QmdError:
        return False  # the first collection reports the error
    return any(
        cell.kind == "code"
        and cell.options.get("eval") is not False
        and STARTS_WORKERS.search(cell.source)
        for cell in cells
    )


def pytest_collect_file(file_path: Path, parent):
    if file_path.suffix != ".qmd":
        return None
    if has_code(file_path):
        return ChapterFile.from_parent(parent, path=file_path)
    # A page of prose only (the References page) is still collected, as a check
    # that it converts, so that naming it in pytest's testpaths is not an error.
    return ProseFile.from_parent(parent, path=file_path)


class SpawnRuns:
    """A second collection hook: each chapter that starts workers, again under spawn."""

    @pytest.hookimpl(trylast=True)  # after the default run of the same chapter
    def pytest_collect_file(self, file_path: Path, parent):
        if file_path.suffix == ".qmd" and starts_workers(file_path):
            node = ChapterFile.from_parent(
                parent, path=file_path, nodeid=f"{_relative(file_path, parent)}[spawn]"
            )
            node.start_method = "spawn"
            return node
        return None


def _relative(path: Path, parent) -> str:
    try:
        return path.relative_to(parent.config.rootpath).as_posix()
    except ValueError:
        return path.name


def pytest_configure(config):
    config.pluginmanager.register(SpawnRuns(), "chapter-harness-spawn-runs")
    # Under pytest-xdist a chapter's cells share one kernel, so they must run on one
    # worker: send whole files (xdist's default, "load", deals out single items).
    if getattr(config.option, "dist", "no") in ("load", "worksteal"):
        config.option.dist = "loadfile"


class ProseFile(pytest.File):
    """A .qmd without code cells: one item checking that it parses."""

    def collect(self):
        yield ProseCheck.from_parent(self, name="parses")


class ProseCheck(pytest.Item):
    def runtest(self):
        parse_qmd(self.path)  # raises QmdError naming the file and line

    def reportinfo(self):
        return self.path, 0, f"{self.path.name}::parses"


class ChapterFile(IPyNbFile):
    """A .qmd chapter as one notebook in one kernel (under ``start_method`` if set)."""

    start_method: str | None = None  # None: the platform's default

    def collect(self):
        try:
            self.nb = from_dict(to_notebook(self.path, for_tests=True))
        except QmdError as error:
            raise self.CollectError(str(error)) from error
        # a first cell, before anything can start a process
        if self.start_method is not None:
            self.nb.cells.insert(
                0,
                from_dict(
                    {
                        "cell_type": "code",
                        "metadata": {"qmd_line": 0},
                        "outputs": [],
                        "execution_count": None,
                        "source": START_METHOD_CELL.format(self.start_method),
                    }
                ),
            )
        self.limit_s = chapter_limit_s(
            self.path, self.config.getoption("--chapter-budget")
        )
        prefix = "" if self.start_method is None else f"{self.start_method}: "
        number = 0
        for cell in self.nb.cells:
            if cell.cell_type != "code":
                continue
            options = defaultdict(bool, find_metadata_tags(cell.metadata))
            # outputs are not compared: the chapter asserts what matters
            options["check"] = False
            first_line = next(
                (
                    line
                    for line in cell.source.splitlines()
                    if line.strip() and not line.startswith("#|")
                ),
                "",
            )
            name = f"{prefix}line {cell.metadata['qmd_line']}: {first_line[:60]}"
            yield ChapterCell.from_parent(
                self, name=name, cell_num=number, cell=cell, options=options
            )
            number += 1

    def setup(self):
        self.started = time.monotonic()
        # The kernel inherits this process's environment (nbval passes no env of its
        # own). Give it a cold torch.compile cache, as a fresh render has, and a cache
        # folder of its own for what it derives (shards, tokenizers, checkpoints), as
        # a fresh clone has: so a chapter builds everything it uses, and its default
        # and spawn runs, side by side under xdist, never share files. The raw data
        # stays where `make test` put it.
        self.scratch = tempfile.TemporaryDirectory(prefix="chapter-")
        self.saved_environment = {name: os.environ.get(name) for name in CHAPTER_ENV}
        os.environ[DATA_VARIABLE] = str(data_dir())
        os.environ[CACHE_VARIABLE] = str(Path(self.scratch.name) / "cache")
        os.environ[COMPILE_CACHE_VARIABLE] = str(Path(self.scratch.name) / "inductor")
        self.kernel = RunningKernel(
            CURRENT_ENV_KERNEL_NAME,
            cwd=str(self.path.parent),
            startup_timeout=KERNEL_STARTUP_TIMEOUT_S,
        )
        self.kernel_process = psutil.Process(self.kernel.km.provisioner.process.pid)
        self.setup_sanitize_files()

    def teardown(self):
        cpu_s = _cpu_seconds(self.kernel_process) if hasattr(self, "kernel") else None
        super().teardown()
        if not hasattr(self, "started"):
            return  # setup never ran
        elapsed = time.monotonic() - self.started
        label = (
            self.path.name
            if self.start_method is None
            else f"{self.path.name} ({self.start_method})"
        )
        # Sent with the last cell's teardown report (made after this teardown), so the
        # summary sees it in the main process under pytest-xdist too.
        last_cell = getattr(self, "last_cell", None)
        if last_cell is not None and cpu_s is not None:
            last_cell.user_properties.append((CHAPTER_TIME, (label, cpu_s, elapsed)))
        self.scratch.cleanup()
        for name, value in self.saved_environment.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


CHAPTER_TIME = "chapter_time"


def _cpu_seconds(process: psutil.Process) -> float | None:
    """CPU seconds of ``process`` and of the children it has waited for."""
    try:
        times = process.cpu_times()
    except psutil.Error:
        return None  # the kernel died; the failing cell says why
    return times.user + times.system + times.children_user + times.children_system


class ChapterCell(IPyNbCell):
    """One code cell of a chapter; failures say where in the .qmd it is."""

    def runtest(self):
        if self.options["skip"]:
            pytest.skip("#| eval: false: shown in the book, never run")
        chapter = self.parent
        chapter.last_cell = self
        remaining = chapter.limit_s - (time.monotonic() - chapter.started)
        if remaining <= 0:
            raise NbCellError(self.cell_num, self._budget_message(), self.cell.source)
        saved = self.config.option.nbval_cell_timeout
        self.config.option.nbval_cell_timeout = remaining
        try:
            super().runtest()
        except NbCellError as error:
            if chapter.timed_out:
                raise NbCellError(
                    self.cell_num, self._budget_message(), self.cell.source
                ) from error
            raise
        finally:
            self.config.option.nbval_cell_timeout = saved
        self._refuse_unexpected_warnings()
        self._require_figure()

    def _require_figure(self):
        label = str(self.cell.metadata.get("qmd_options", {}).get("label", ""))
        if not label.startswith("fig-"):
            return
        if not any(
            key.startswith("image/")
            for output in self.test_outputs or []
            for key in output.get("data", {})
        ):
            raise NbCellError(
                self.cell_num,
                f"the cell is labelled {label!r} but produced no image: "
                "its figure would be missing from the page",
                self.cell.source,
            )

    def _budget_message(self) -> str:
        return (
            f"{self.parent.path.name} ran past its limit "
            f"of {self.parent.limit_s:.0f} s for the whole chapter"
        )

    def _refuse_unexpected_warnings(self):
        if "warning" in self.cell.metadata.get("qmd_options", {}):
            return  # the chapter decided what to show
        for output in self.test_outputs or []:
            text = output.get("text", "") if output.get("name") == "stderr" else ""
            if any(marker in text for marker in WARNING_MARKERS):
                raise NbCellError(
                    self.cell_num,
                    "the cell printed a warning the chapter does not mean to show "
                    "(fix its cause, or add '#| warning: false' / '#| warning: true')",
                    self.cell.source,
                    text,
                )

    def repr_failure(self, excinfo):
        chapter = self.parent.path
        line = self.cell.metadata.get("qmd_line")
        first = re.sub(r"^(\w+: )?line \d+: ", "", self.name)
        start_method = self.parent.start_method
        heading = (
            f"{chapter.parent.name}/{chapter.name}:{line}: cell `{first}` failed"
            + (f" under the {start_method} start method" if start_method else "")
        )
        error = excinfo.value
        if isinstance(error, NbCellError):
            detail = str(error)
            if error.inner_traceback:
                detail += "\n" + _last_lines(error.inner_traceback, 25)
            return f"{heading}\n{detail}"
        return f"{heading}\n{super().repr_failure(excinfo)}"

    def reportinfo(self):
        return (
            self.path,
            self.cell.metadata.get("qmd_line", 1) - 1,
            f"{self.path.name}::{self.name}",
        )


def _last_lines(text: str, count: int) -> str:
    lines = text.strip("\n").splitlines()
    return "\n".join(lines[-count:])


def pytest_runtest_logreport(report):
    """Collect chapter times from reports, which reach the main process under xdist."""
    for name, value in getattr(report, "user_properties", ()):
        if name == CHAPTER_TIME:
            label, cpu_s, wall_s = value
            _times_seen[label] = (cpu_s, wall_s)


_times_seen: dict[str, tuple[float, float]] = {}


def pytest_terminal_summary(terminalreporter, config):
    if not _times_seen:
        return
    terminalreporter.section("chapter times (CPU seconds: the time alone on one core)")
    for name, (cpu_s, wall_s) in sorted(_times_seen.items()):
        budget = chapter_budget_s(name)
        over = f" (over its {budget:.0f} s budget)" if cpu_s > budget else ""
        terminalreporter.write_line(
            f"{name}: {cpu_s:.1f} s CPU, {wall_s:.1f} s wall{over}"
        )
