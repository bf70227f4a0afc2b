"""The package's copy rule: a module imports from ``torchbook`` only its two helpers, unless it says otherwise."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "code" / "torchbook"
HELPERS = {"profiles", "files"}  # any module may import these
MODULES = sorted(path.stem for path in PACKAGE.glob("*.py") if path.stem != "__init__")


def package_imports(path: Path) -> set[str]:
    """The ``torchbook`` modules that ``path`` imports, by their short names."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torchbook."):
            names.add(node.module.split(".")[1])
        elif isinstance(node, ast.ImportFrom) and node.module == "torchbook":
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name.split(".")[1] for alias in node.names if alias.name.startswith("torchbook."))
    return names


@pytest.mark.parametrize("module", MODULES)
def test_a_module_builds_on_another_only_where_its_docstring_says_so(module):
    path = PACKAGE / f"{module}.py"
    others = sorted(package_imports(path) - HELPERS)
    docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    if others:
        assert "builds on" in docstring, f"{module} imports {others} but its docstring says not what it builds on"
        unnamed = [name for name in others if f"torchbook.{name}" not in docstring]
        assert not unnamed, f"{module}'s docstring does not name torchbook.{unnamed[0]}, which it imports"


def test_the_package_docstring_lists_every_module():
    import torchbook

    unlisted = [module for module in MODULES if f"``{module}``" not in (torchbook.__doc__ or "")]
    assert not unlisted, f"torchbook/__init__.py does not describe {unlisted}"
