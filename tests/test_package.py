"""The package's copy rule: each module, copied with what it declares, imports.

A module imports from ``torchbook`` only its helpers and what its docstring declares.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "code" / "torchbook"
HELPERS = {"device", "profiles", "files"}  # any module may import these
MODULES = sorted(path.stem for path in PACKAGE.glob("*.py") if path.stem != "__init__")


def package_imports(path: Path) -> set[str]:
    """The ``torchbook`` modules that ``path`` imports, by their short names."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if (
            isinstance(node, ast.ImportFrom)
            and node.module
            and node.module.startswith("torchbook.")
        ):
            names.add(node.module.split(".")[1])
        elif isinstance(node, ast.ImportFrom) and node.module == "torchbook":
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(
                alias.name.split(".")[1]
                for alias in node.names
                if alias.name.startswith("torchbook.")
            )
    return names


@pytest.mark.parametrize("module", MODULES)
def test_a_module_builds_on_another_only_where_its_docstring_says_so(module):
    path = PACKAGE / f"{module}.py"
    others = sorted(package_imports(path) - HELPERS)
    docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    if others:
        assert "builds on" in docstring, (
            f"{module} imports {others} but its docstring says not what it builds on"
        )
        unnamed = [name for name in others if f"torchbook.{name}" not in docstring]
        assert not unnamed, (
            f"{module}'s docstring does not name torchbook.{unnamed[0]}, "
            "which it imports"
        )


def test_the_package_docstring_lists_every_module():
    import torchbook

    unlisted = [
        module for module in MODULES if f"``{module}``" not in (torchbook.__doc__ or "")
    ]
    assert not unlisted, f"torchbook/__init__.py does not describe {unlisted}"


# A module a reader can read in one sitting; ruff's formatter (make test) keeps the
# lines honest, so a shorter module is a cut one, never a packed one.
MAX_MODULE_LINES = 500


@pytest.mark.parametrize("module", MODULES)
def test_a_module_stays_within_the_lines_a_reader_reads_at_once(module):
    lines = len((PACKAGE / f"{module}.py").read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, f"torchbook/{module}.py has {lines} lines"


def declared_closure(module: str) -> set[str]:
    """``module``, the modules it builds on, transitively, and the helpers they import.

    What a module builds on is what its docstring declares.
    """
    needed, todo = set(), [module]
    while todo:
        name = todo.pop()
        if name in needed:
            continue
        needed.add(name)
        path = PACKAGE / f"{name}.py"
        docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        declared = {other for other in MODULES if f"torchbook.{other}" in docstring}
        todo.extend((declared | (package_imports(path) & HELPERS)) - needed)
    return needed


PROBE = """
import importlib, json, sys
errors = {}
for module, folder in json.loads(sys.argv[1]).items():
    for name in list(sys.modules):
        if name == "torchbook" or name.startswith("torchbook."):
            del sys.modules[name]
    sys.path.insert(0, folder)
    try:
        importlib.import_module("torchbook." + module)
        outside = [
            name
            for name, loaded in sys.modules.items()
            if name.startswith("torchbook")
            and not (getattr(loaded, "__file__", "") or "").startswith(folder)
        ]
        if outside:
            errors[module] = "loaded from outside the copies: " + ", ".join(outside)
    except Exception as error:
        errors[module] = f"{type(error).__name__}: {error}"
    sys.path.remove(folder)
print(json.dumps(errors))
"""


@pytest.fixture(scope="module")
def copy_errors(tmp_path_factory) -> dict[str, str]:
    """Each module copied with its declared closure to a project of its own, imported.

    Every project is a fresh folder holding a ``torchbook`` package of copies
    only. One interpreter imports them in turn (torch is imported once), putting
    each project first on the path and forgetting the previous copies; a module
    counts only if every ``torchbook`` module it loaded is one of its copies.
    """
    folders = {}
    for module in MODULES:
        project = tmp_path_factory.mktemp(f"copy-{module}")
        copied = project / "torchbook"
        copied.mkdir()
        (copied / "__init__.py").write_text("", encoding="utf-8")
        for name in declared_closure(module):
            (copied / f"{name}.py").write_text(
                (PACKAGE / f"{name}.py").read_text(encoding="utf-8"), encoding="utf-8"
            )
        folders[module] = str(project)
    result = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(folders)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path_factory.getbasetemp(),
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", MODULES)
def test_a_module_copied_with_what_it_declares_imports_without_the_package(
    module, copy_errors
):
    assert module not in copy_errors, (
        f"{module} copied with {sorted(declared_closure(module))} "
        f"does not import: {copy_errors[module]}"
    )


def package_guide() -> dict[str, set[str]]:
    """What ``torchbook/__init__.py`` says each module builds on, by its bullet.

    A bullet reads ``- ``name``: what it does (builds on ``a``, ``b`` and ``c``).``;
    a bullet without "builds on" declares nothing.
    """
    import re

    import torchbook

    guide = {}
    for bullet in re.split(r"\n- ", torchbook.__doc__ or "")[1:]:
        name = re.match(r"``(\w+)``", bullet)
        if name is None:
            continue
        bullet = " ".join(bullet.split())  # "builds on" may break across lines
        declared = bullet.split("builds on", 1)[1] if "builds on" in bullet else ""
        guide[name.group(1)] = set(re.findall(r"``(\w+)``", declared)) & set(MODULES)
    return guide


@pytest.mark.parametrize("module", MODULES)
def test_the_package_guide_names_what_each_module_imports(module):
    # A reader copies a module with what the guide names: it must be exactly what the
    # module imports from the package, besides the three helpers.
    imported = package_imports(PACKAGE / f"{module}.py") - HELPERS
    declared = package_guide().get(module, set()) - HELPERS
    assert declared == imported, (
        f"torchbook/__init__.py says {module} builds on {sorted(declared)}; "
        f"it imports {sorted(imported)}"
    )
