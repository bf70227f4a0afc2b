"""Results files of full-size runs: format, bad files refused, staleness, the writer."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torchbook.book.charlm import load_corpus
from torchbook.book.plotting import plot_history
from torchbook.book.profiles import LabSizes
from torchbook.book.results import (
    ResultsError,
    find_results,
    history_rows,
    history_series,
    import_closure,
    make_provenance,
    read_result,
    referenced_modules,
    run_sources,
    stale_sources,
    write_result,
)
from torchbook.device import hardware_name

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def sources(tmp_path: Path) -> Path:
    """A tiny repository with two source files a run depends on."""
    root = tmp_path / "repo"
    (root / "code").mkdir(parents=True)
    (root / "code" / "model.py").write_text("LAYERS = 2\n")
    (root / "code" / "train.py").write_text("LR = 3e-4\n")
    return root


def write_example(folder: Path, root: Path, name: str = "lm-cpu.json") -> Path:
    provenance = make_provenance(
        torch.device("cpu"), root, ["code/model.py", "code/train.py"], wall_seconds=1.5
    )
    history = {
        "train": {"step": [1, 2, 3], "loss": [4.0, 3.0, 2.5]},
        "val": {"step": [3], "loss": [2.7]},
    }
    return write_result(
        folder / name, "lm", "cpu", {"final_val_loss": 2.7}, history, provenance
    )


def test_a_written_result_reads_back_with_its_history_and_provenance(tmp_path, sources):
    path = write_example(tmp_path, sources)
    result = read_result(path)
    assert result.run == "lm" and result.profile == "cpu"
    assert result.history["train"]["loss"] == [4.0, 3.0, 2.5]
    assert result.metrics == {"final_val_loss": 2.7}
    assert result.provenance["torch_version"] == torch.__version__
    assert result.provenance["wall_seconds"] == 1.5
    assert set(result.provenance["sources"]) == {"code/model.py", "code/train.py"}
    # the caption's label: the hardware in words, then the date
    name, date = result.label.rsplit(", ", 1)
    assert name == hardware_name(torch.device("cpu"))
    assert date == result.provenance["date"][:10]


def test_a_trainer_history_survives_the_trip_through_a_results_file(tmp_path, sources):
    history = [
        {
            "step": 10,
            "loss": 3.0,
            "lr": 1e-3,
            "grad_norm": 2.0,
            "tokens_per_second": 900.0,
        },
        {
            "step": 20,
            "loss": 2.5,
            "lr": 1e-3,
            "grad_norm": 1.5,
            "tokens_per_second": 950.0,
            "val_loss": 2.6,
        },
        {
            "step": 30,
            "loss": 2.2,
            "lr": 5e-4,
            "grad_norm": 1.2,
            "tokens_per_second": 940.0,
            "val_loss": 2.4,
        },
    ]
    provenance = make_provenance(
        torch.device("cpu"), sources, ["code/model.py"], wall_seconds=2.0
    )
    path = write_result(
        tmp_path / "lm-cpu.json", "lm", "cpu", {}, history_series(history), provenance
    )
    assert history_rows(read_result(path)) == history


def test_find_results_returns_every_file_of_one_run(tmp_path, sources):
    write_example(tmp_path, sources, "lm-cpu.json")
    write_example(tmp_path, sources, "lm-gpu.json")
    write_example(tmp_path, sources, "lab-cpu.json")  # another run's name: not returned
    assert sorted(result.path.name for result in find_results(tmp_path, "lm")) == [
        "lm-cpu.json",
        "lm-gpu.json",
    ]
    assert find_results(tmp_path / "absent", "lm") == []


def test_a_dry_run_file_reads_back_as_one_and_is_never_found_as_a_result(
    tmp_path, sources
):
    provenance = make_provenance(
        torch.device("cpu"), sources, ["code/model.py"], wall_seconds=1.0
    )
    history = {"train": {"step": [1, 2], "loss": [4.0, 3.5]}}
    dry = write_result(
        tmp_path / "lm-gpu-dry-run.json",
        "lm",
        "gpu",
        {"steps": 2},
        history,
        provenance,
        dry_run=True,
    )
    real = write_example(tmp_path, sources, "lm-cpu.json")
    assert read_result(dry).dry_run and not read_result(real).dry_run
    assert [result.path for result in find_results(tmp_path, "lm")] == [real]


def test_a_dry_run_flag_that_is_not_a_boolean_is_refused_naming_the_file(
    tmp_path, sources
):
    path = write_example(tmp_path, sources)
    document = json.loads(path.read_text())
    document["dry_run"] = "yes"
    path.write_text(json.dumps(document))
    with pytest.raises(
        ResultsError, match=r"lm-cpu\.json: 'dry_run' must be true or false"
    ):
        read_result(path)


def test_a_result_is_fresh_until_a_source_it_depends_on_changes(tmp_path, sources):
    result = read_result(write_example(tmp_path, sources))
    assert stale_sources(result, sources) == []
    (sources / "code" / "train.py").write_text("LR = 1e-3\n")
    assert stale_sources(result, sources) == ["code/train.py"]


def test_a_deleted_source_makes_the_result_stale(tmp_path, sources):
    result = read_result(write_example(tmp_path, sources))
    (sources / "code" / "model.py").unlink()
    assert stale_sources(result, sources) == ["code/model.py"]


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b'{"format": "torchbook.book.results", "vers', "not valid JSON"),
        (b"\xff\xfe not utf-8", "not UTF-8"),
        (b'{"model.embed.weight": [1, 2]}', "not a results file of this book"),
        (b"[1, 2, 3]", "expected a JSON object"),
    ],
)
def test_a_truncated_or_foreign_file_is_refused_with_its_name(
    tmp_path, content, expected
):
    path = tmp_path / "lm-gpu.json"
    path.write_bytes(content)
    with pytest.raises(ResultsError, match=expected) as caught:
        read_result(path)
    assert str(path) in str(caught.value)


def edited(path: Path, change) -> Path:
    document = json.loads(path.read_text())
    change(document)
    path.write_text(json.dumps(document))
    return path


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda d: d.update(version=99), "'version'"),
        (lambda d: d.update(run=""), "'run'"),
        (
            lambda d: d["metrics"].update(final_val_loss="2.7"),
            "metrics['final_val_loss']",
        ),
        (lambda d: d["history"]["train"].update(loss=[4.0, 3.0]), "history['train']"),
        (lambda d: d["history"].update(val=[2.7]), "history['val']"),
        (lambda d: d["provenance"].pop("device_name"), "provenance['device_name']"),
        (
            lambda d: d["provenance"]["sources"].update({"code/model.py": "abc"}),
            "SHA-256",
        ),
    ],
)
def test_a_malformed_field_is_refused_naming_the_file_and_the_field(
    tmp_path, sources, change, field
):
    path = edited(write_example(tmp_path, sources), change)
    with pytest.raises(ResultsError) as caught:
        read_result(path)
    assert str(path) in str(caught.value) and field in str(caught.value)


def test_write_result_refuses_what_could_not_be_read_back_and_leaves_no_file(
    tmp_path, sources
):
    provenance = make_provenance(
        torch.device("cpu"), sources, ["code/model.py"], wall_seconds=1.0
    )
    out = tmp_path / "results"
    with pytest.raises(ResultsError, match="finite number"):
        write_result(
            out / "lm-cpu.json", "lm", "cpu", {"loss": float("nan")}, {}, provenance
        )
    assert not out.exists() or list(out.iterdir()) == []


def test_provenance_refuses_a_source_that_does_not_exist(sources):
    with pytest.raises(ResultsError, match="does not exist"):
        make_provenance(
            torch.device("cpu"), sources, ["code/missing.py"], wall_seconds=1.0
        )


@pytest.mark.slow
def test_the_cpu_profile_run_of_the_command_writes_a_results_file_the_book_reads(
    tmp_path,
):
    environment = {**os.environ, "QUARTO_PROFILE": "cpu"}
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "gpu_results.py"),
            "--out",
            str(tmp_path),
            "--max-steps",
            "4",
            "--only",
            "lm",
        ],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    [result] = find_results(tmp_path, "lm")
    assert result.profile == "cpu" and result.metrics["steps"] == 4
    assert result.history["val"]["step"] == [4.0]
    assert stale_sources(result, ROOT) == []  # made from the code as it is now
    assert result.provenance["git_commit"] != ""
    # Plotted as chapter 3 plots it: the legend names the stored run's device and date.
    stored = f"stored: {result.profile} profile, {result.label}"
    figure = plot_history(
        {"live": [{"step": 4, "val_loss": 3.0}], stored: history_rows(result)},
        keys=("val_loss",),
    )
    legend = [text.get_text() for text in figure.axes[0].get_legend().get_texts()]
    assert f"{stored}: validation" in legend, legend


def test_reading_a_folder_names_it(tmp_path):
    with pytest.raises(
        ResultsError, match=rf"{tmp_path}: cannot be read as a results file"
    ):
        read_result(tmp_path)


@pytest.mark.parametrize("metric", ["2.7", None, [2.7]])
def test_writing_a_metric_that_is_not_a_number_names_the_file(
    tmp_path, sources, metric
):
    provenance = make_provenance(
        torch.device("cpu"), sources, ["code/model.py"], wall_seconds=1.0
    )
    with pytest.raises(
        ResultsError, match=r"lm-cpu\.json: metrics\['loss'\] must be a finite number"
    ):
        write_result(
            tmp_path / "out" / "lm-cpu.json",
            "lm",
            "cpu",
            {"loss": metric},
            {},
            provenance,
        )
    assert not (tmp_path / "out").exists()


def replace_text(path: Path, old: str, new: str) -> Path:
    """Edit the file's text: json.dumps could not write some of these documents."""
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))
    return path


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        (
            '"final_val_loss": 2.7',
            '"final_val_loss": 1' + "0" * 400,
            r"metrics\['final_val_loss'\] must be a finite",
        ),
        (
            '"wall_seconds": 1.5',
            '"wall_seconds": 1' + "0" * 400,
            r"provenance\['wall_seconds'\]",
        ),
        (
            '"final_val_loss": 2.7',
            '"final_val_loss": 1' + "0" * 5_000,
            "not valid JSON",
        ),
        (
            '"final_val_loss": 2.7',
            '"final_val_loss": ' + "[" * 2_000 + "]" * 2_000,
            "not valid JSON",
        ),
    ],
    ids=[
        "400-digit metric",
        "400-digit wall_seconds",
        "5000-digit metric",
        "nested 2000 deep",
    ],
)
def test_a_number_too_large_or_nesting_too_deep_is_refused_naming_the_file(
    tmp_path, sources, old, new, expected
):
    # Each once escaped as OverflowError, ValueError or RecursionError, naming no file.
    path = replace_text(write_example(tmp_path, sources), old, new)
    with pytest.raises(ResultsError, match=expected) as caught:
        read_result(path)
    assert str(path) in str(caught.value)


def imported_by(statement: str) -> set[str]:
    """The package's modules a fresh interpreter imports for ``statement``."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", statement],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    names = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines()]
    paths = set()
    for name in names:
        if name.startswith("torchbook."):
            path = Path("code", *name.split("."))
            is_package = (ROOT / path / "__init__.py").is_file()
            paths.add(path / "__init__.py" if is_package else path.with_suffix(".py"))
    return {path.as_posix() for path in paths}


def imported_inside_functions(paths: set[str]) -> set[str]:
    """The ``torchbook`` modules that a function in ``paths`` imports when it runs."""
    names = set()
    for path in paths:
        tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
        for function in ast.walk(tree):
            if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(function):
                if isinstance(node, ast.ImportFrom) and node.module:
                    names.add(node.module)
    return {name for name in names if name.startswith("torchbook.")}


@pytest.mark.parametrize("module", ["torchbook.book.charlm", "torchbook.book.dry_run"])
def test_the_import_closure_is_what_python_imports_and_what_functions_may(module):
    # Python's own record, from a fresh interpreter, against the files' import lines:
    # nothing it imports is missing; beyond it, the closure holds only what a function
    # imports when called (a function's own import), which a run may call.
    closure = set(import_closure([module], ROOT))
    imported = imported_by(f"import {module}")
    assert imported <= closure
    lazily = set(import_closure(imported_inside_functions(closure), ROOT))
    assert closure - imported <= lazily


def uses_the_corpus_through_a_helper() -> None:
    """A run function whose package names are only in a helper of this module."""
    helper_that_loads()


def helper_that_loads() -> None:
    load_corpus  # noqa: B018 - only named, as a run function names what it calls


def sized(sizes: LabSizes) -> None:
    """A run function whose sizes come from torchbook.book.profiles, by its type."""


def test_a_runs_modules_are_found_through_its_helpers_and_its_parameter_types():
    assert referenced_modules(uses_the_corpus_through_a_helper, "torchbook") == {
        "torchbook.book.charlm"
    }
    assert referenced_modules(sized, "torchbook") == {"torchbook.book.profiles"}


def test_a_runs_sources_are_its_script_and_what_its_modules_import():
    sources = run_sources(
        uses_the_corpus_through_a_helper, "tests/test_results.py", ROOT
    )
    assert sources == sorted(
        {"tests/test_results.py", *imported_by("import torchbook.book.charlm")}
    )
