"""Results of full-size runs as small JSON files with their provenance.

A lent GPU machine has no Quarto, and Quarto's ``_freeze`` folder knows neither
the profile nor the code a result came from. So the runs whose full-size
results the book shows (``make gpu-results``) write one JSON file each, which
a chapter reads with ``find_results`` when the file exists.

A file holds the run's name and profile, its history (named series of
columns, each a list of numbers), its
final metrics, and a ``provenance`` record: device name and compute
capability, CUDA and torch versions, date, git commit, and the SHA-256 of each
source file the run depends on. ``stale_sources`` compares those hashes with
the files as they are now; the appendix lists each file with what changed.
A run's sources are derived, not listed by hand: ``run_sources`` takes the
package modules its function names (through the helpers of its own script)
and every package module those import (``import_closure``).

Reading validates the whole structure first and raises ``ResultsError`` naming
the file and the field, so a truncated, hand-edited or foreign JSON file is
refused rather than half-plotted.
"""

from __future__ import annotations

import ast
import datetime
import hashlib
import importlib.util
import inspect
import json
import math
import platform
import subprocess
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from torchbook.device import hardware_name
from torchbook.files import atomic_write_text

RESULTS_FORMAT = "torchbook.book.results"
RESULTS_VERSION = 1
PROVENANCE_FIELDS = {
    "device": str,  # "cuda", "mps" or "cpu"
    "device_name": str,  # "NVIDIA H200", or the CPU's description
    "device_capability": str,  # "9.0" on Hopper; "" off CUDA
    "cuda_version": str,  # torch.version.cuda, "" off CUDA
    "torch_version": str,
    "python_version": str,
    "date": str,  # ISO 8601, UTC
    "git_commit": str,  # "" outside a git checkout
    "wall_seconds": float,  # the run's own time
    # repository-relative path -> SHA-256 of the file the run depends on
    "sources": dict,
}


class ResultsError(ValueError):
    """A results file is missing, malformed or of another kind; names file and field."""


@dataclass(frozen=True)
class RunResult:
    """One validated results file."""

    path: Path
    run: str
    profile: str
    metrics: dict[str, float]
    # series -> column -> values, e.g. history["val"]["loss"]
    history: dict[str, dict[str, list[float]]]
    provenance: dict[str, Any]
    dry_run: bool = False  # True: a dry run's file (fake tensors, no GPU); not results

    @property
    def label(self) -> str:
        """Where and when, for a caption: ``NVIDIA H200, 2026-12-03``."""
        return f"{self.provenance['device_name']}, {self.provenance['date'][:10]}"


def sha256_of_file(path: str | Path) -> str:
    """Hex SHA-256 of a file's bytes."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def source_hashes(root: str | Path, sources: Iterable[str]) -> dict[str, str]:
    """SHA-256 of each repository-relative source path below ``root``."""
    root = Path(root)
    hashes = {}
    for name in sorted(sources):
        path = root / name
        if not path.is_file():
            raise ResultsError(
                f"{path}: a run depends on this source file, and it does not exist"
            )
        hashes[name] = sha256_of_file(path)
    return hashes


def import_closure(
    modules: Iterable[str], root: str | Path, package: str = "torchbook"
) -> list[str]:
    """``modules`` and the modules of ``package`` they import, transitively: paths.

    Read from each file's ``import`` statements (those inside functions too, so
    a module counts if the run might import it); paths relative to ``root``.
    Importing ``torchbook.memory.step`` runs ``torchbook/memory/__init__.py``
    first, so a sub-package's ``__init__.py`` counts with each of its modules.
    The package's own ``__init__.py`` holds only its guide, and is left out.
    """
    folder = Path(importlib.util.find_spec(package).origin).parent

    def path_of(name: str) -> Path | None:  # "torchbook.memory.step" -> .../step.py
        head, _, rest = name.partition(".")
        if head != package or not rest:
            return None
        path = folder.joinpath(*rest.split("."))
        for candidate in (path.with_suffix(".py"), path / "__init__.py"):
            if candidate.is_file():
                return candidate
        return None

    pending, found = list(modules), set()
    while pending:
        name = pending.pop()
        path = path_of(name)
        if path is None or path in found:
            continue
        found.add(path)
        parent = name.rpartition(".")[0]
        if parent != package:  # a sub-package's __init__.py runs before its modules
            pending.append(parent)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                pending += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                # "from package import module" names a module, or a name of __init__
                pending += [f"{node.module}.{alias.name}" for alias in node.names]
                pending.append(node.module)
    root = Path(root).resolve()
    return sorted(path.resolve().relative_to(root).as_posix() for path in found)


def referenced_modules(function: Callable, package: str) -> set[str]:
    """The modules of ``package`` that ``function`` uses: names, parameter types.

    Followed through the functions and classes of ``function``'s own module
    that it calls (a script's helpers), and the functions nested in each.
    """
    found, seen, pending = set(), set(), [function]
    while pending:
        item = pending.pop()
        if id(item) in seen or not (inspect.isclass(item) or inspect.isfunction(item)):
            continue
        seen.add(id(item))
        if inspect.isclass(item):
            pending += vars(item).values()
            continue
        codes, used = [item.__code__], []
        while codes:
            code = codes.pop()
            codes += [c for c in code.co_consts if inspect.iscode(c)]
            used += [item.__globals__.get(name) for name in code.co_names]
        try:  # the sizes a run takes are a source too (Profile, LabSizes, ...)
            hints = inspect.get_annotations(item, eval_str=True).values()
        except (NameError, TypeError):
            hints = []
        types = [t for hint in hints for t in (hint, *typing.get_args(hint))]
        for value in [*used, *types]:
            module = getattr(value, "__module__", None)
            if inspect.ismodule(value):
                module = value.__name__
            if module is not None and module.partition(".")[0] == package:
                found.add(module)
            elif module == function.__module__ and all(value is not t for t in types):
                pending.append(value)
    return found


def run_sources(function: Callable, script: str, root: str | Path) -> list[str]:
    """What a run's numbers depend on: its ``script`` and the package code it uses."""
    package = "torchbook"
    return sorted(
        {script, *import_closure(referenced_modules(function, package), root)}
    )


def git_commit(root: str | Path) -> str:
    """The checked-out commit of the repository at ``root``, or "" if there is none."""
    try:
        done = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def describe_device(device: torch.device) -> tuple[str, str, str]:
    """(device name, compute capability, CUDA version) as strings for the provenance."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return (
            hardware_name(device),
            f"{major}.{minor}",
            torch.version.cuda or "",
        )
    return hardware_name(device), "", ""


def make_provenance(
    device: torch.device, root: str | Path, sources: Iterable[str], wall_seconds: float
) -> dict[str, Any]:
    """The provenance of a run made now on ``device`` from the sources in ``root``."""
    name, capability, cuda = describe_device(torch.device(device))
    return {
        "device": torch.device(device).type,
        "device_name": name,
        "device_capability": capability,
        "cuda_version": cuda,
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "git_commit": git_commit(root),
        "wall_seconds": float(wall_seconds),
        "sources": source_hashes(root, sources),
    }


def write_result(
    path: str | Path,
    run: str,
    profile: str,
    metrics: Mapping[str, float],
    history: Mapping[str, Mapping[str, Iterable[float]]],
    provenance: Mapping[str, Any],
    dry_run: bool = False,
) -> Path:
    """Write one run's results atomically as JSON, after checking they would read back.

    ``history`` maps a series name ("train", "val", "adamw", ...) to its columns
    ("step", "loss", ...), each a list with one number per row. A ``dry_run``
    file says so, and ``find_results`` never returns it.
    """
    path = Path(path)
    document = {
        "format": RESULTS_FORMAT,
        "version": RESULTS_VERSION,
        "run": run,
        "profile": profile,
        "metrics": {key: _as_float(value) for key, value in metrics.items()},
        "history": {
            series: {
                key: [_as_float(value) for value in values]
                if isinstance(values, Iterable)
                and not isinstance(values, (str, bytes, Mapping))
                else values
                for key, values in columns.items()
            }
            if isinstance(columns, Mapping)
            else columns
            for series, columns in history.items()
        },
        "provenance": dict(provenance),
        "dry_run": dry_run,
    }
    _validate(document, path)  # refuse to write what read_result would refuse
    return atomic_write_text(
        path, json.dumps(document, indent=1, allow_nan=False) + "\n"
    )


def _as_float(value: Any) -> Any:
    """A number (NumPy or torch scalars too) as a float; anything else as is.

    ``_validate`` then names what is not a number.
    """
    if isinstance(value, (str, bool)) or value is None:
        return value
    try:
        return float(value)
    except (TypeError, ValueError):
        return value


def _is_finite_number(value: Any) -> bool:
    """True for an int or float a float holds; not 1e400 (inf) or a 400-digit int."""
    try:
        return (
            not isinstance(value, bool)
            and isinstance(value, (int, float))
            and math.isfinite(value)
        )
    except OverflowError:  # an int too large for a float
        return False


def _numbers(value: Any, where: str, path: Path) -> None:
    if not _is_finite_number(value):
        raise ResultsError(
            f"{path}: {where} must be a finite number, got {value!r:.80}"
        )


def _validate(document: Any, path: Path) -> None:
    """Raise ResultsError unless ``document`` is a complete results record."""
    if not isinstance(document, dict):
        raise ResultsError(
            f"{path}: expected a JSON object, got {type(document).__name__}"
        )
    if document.get("format") != RESULTS_FORMAT:
        raise ResultsError(
            f"{path}: 'format' is {document.get('format')!r}, "
            f"expected {RESULTS_FORMAT!r}; "
            "not a results file of this book"
        )
    if document.get("version") != RESULTS_VERSION:
        raise ResultsError(
            f"{path}: 'version' is {document.get('version')!r}, "
            f"expected {RESULTS_VERSION}"
        )
    for key in ("run", "profile"):
        if not isinstance(document.get(key), str) or not document[key]:
            raise ResultsError(
                f"{path}: {key!r} must be a non-empty string, got {document.get(key)!r}"
            )
    metrics, history = document.get("metrics"), document.get("history")
    if not isinstance(metrics, dict):
        raise ResultsError(
            f"{path}: 'metrics' must be an object, got {type(metrics).__name__}"
        )
    for key, value in metrics.items():
        _numbers(value, f"metrics[{key!r}]", path)
    if not isinstance(history, dict):
        raise ResultsError(
            f"{path}: 'history' must be an object of series, "
            f"got {type(history).__name__}"
        )
    for series, columns in history.items():
        if not isinstance(columns, dict) or not columns:
            raise ResultsError(
                f"{path}: history[{series!r}] must be a non-empty object of columns"
            )
        lengths = set()
        for key, values in columns.items():
            if not isinstance(values, list):
                raise ResultsError(
                    f"{path}: history[{series!r}][{key!r}] must be a list, "
                    f"got {type(values).__name__}"
                )
            for index, value in enumerate(values):
                _numbers(value, f"history[{series!r}][{key!r}][{index}]", path)
            lengths.add(len(values))
        if len(lengths) > 1:
            raise ResultsError(
                f"{path}: the columns of history[{series!r}] have different lengths "
                f"{sorted(lengths)}; each column must hold one value per row"
            )
    if not isinstance(document.get("dry_run", False), bool):
        raise ResultsError(
            f"{path}: 'dry_run' must be true or false, got {document['dry_run']!r:.80}"
        )
    provenance = document.get("provenance")
    if not isinstance(provenance, dict):
        raise ResultsError(
            f"{path}: 'provenance' must be an object, got {type(provenance).__name__}"
        )
    for key, kind in PROVENANCE_FIELDS.items():
        value = provenance.get(key)
        if (
            kind is float
            and not _is_finite_number(value)
            or kind is not float
            and not isinstance(value, kind)
        ):
            raise ResultsError(
                f"{path}: provenance[{key!r}] must be {kind.__name__}, "
                f"got {value!r:.80}"
            )
    for name, digest in provenance["sources"].items():
        if not isinstance(digest, str) or len(digest) != 64:
            raise ResultsError(
                f"{path}: provenance['sources'][{name!r}] must be a SHA-256 hex digest"
            )


def read_result(path: str | Path) -> RunResult:
    """Read and validate one results file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ResultsError(f"{path}: no such results file") from None
    except UnicodeDecodeError as error:
        raise ResultsError(
            f"{path}: not UTF-8 text ({error.reason} at byte {error.start})"
        ) from None
    except OSError as error:  # a folder, no permission
        raise ResultsError(
            f"{path}: cannot be read as a results file ({error.strerror or error})"
        ) from None
    try:
        document = json.loads(text)
    except json.JSONDecodeError as error:
        raise ResultsError(
            f"{path}: not valid JSON ({error.msg} at line {error.lineno}); "
            "was the write interrupted or the file edited by hand?"
        ) from None
    # an int of over 4,300 digits; nesting deeper than Python's stack
    except (
        ValueError,
        RecursionError,
    ) as error:
        raise ResultsError(
            f"{path}: not valid JSON for a results file "
            f"({type(error).__name__}: {error})"
        ) from None
    _validate(document, path)
    return RunResult(
        path=path,
        run=document["run"],
        profile=document["profile"],
        metrics=document["metrics"],
        history=document["history"],
        provenance=document["provenance"],
        dry_run=document.get("dry_run", False),
    )


def find_results(folder: str | Path, run: str) -> list[RunResult]:
    """Every results file ``<run>-*.json`` in ``folder``, newest first; [] if none.

    Dry runs are left out: their numbers come from fake tensors, not a GPU.
    """
    folder = Path(folder)
    found = [
        result
        for result in map(read_result, sorted(folder.glob(f"{run}-*.json")))
        if not result.dry_run
    ]
    return sorted(found, key=lambda result: result.provenance["date"], reverse=True)


def history_series(history: list[dict]) -> dict[str, dict[str, list[float]]]:
    """A ``Trainer`` history as a results file's series, "train" and "val".

    "train" holds every row, "val" the rows with a ``val_loss``.
    """
    train_keys = [
        key
        for key in ("step", "loss", "lr", "grad_norm", "tokens_per_second")
        if all(key in row for row in history)
    ]
    train = {key: [float(row[key]) for row in history] for key in train_keys}
    evaluated = [row for row in history if "val_loss" in row]
    val = {
        "step": [float(row["step"]) for row in evaluated],
        "loss": [float(row["val_loss"]) for row in evaluated],
    }
    return {"train": train, "val": val}


def history_rows(result: RunResult) -> list[dict[str, float]]:
    """Inverse of ``history_series``: a dict per logged step, ``val_loss`` if any."""
    train = result.history.get("train", {})
    rows = [
        dict(zip(train, values, strict=True))
        for values in zip(*train.values(), strict=True)
    ]
    val = result.history.get("val", {})
    val_losses = dict(zip(val.get("step", []), val.get("loss", []), strict=True))
    for row in rows:
        if row["step"] in val_losses:
            row["val_loss"] = val_losses[row["step"]]
    return rows


def stale_sources(result: RunResult, root: str | Path) -> list[str]:
    """The result's source files that changed or vanished since it was made."""
    root = Path(root)
    changed = []
    for name, digest in result.provenance["sources"].items():
        path = root / name
        if not path.is_file() or sha256_of_file(path) != digest:
            changed.append(name)
    return changed
