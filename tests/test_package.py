"""The package's layout and copy rule.

What readers copy stands at the top of ``code/torchbook``; the memory calculator's
family lives in ``memory/``; what only makes the book lives in ``book/``, which
nothing outside it imports. A module imports from ``torchbook`` only the two small
helpers and what its docstring declares, and copied with what it declares (and the
``__init__.py`` of the folder it sits in), it imports in an empty project.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "code" / "torchbook"
HELPERS = {"device", "files"}  # any module may import these
BOOK = "book"  # the book's own machinery: nothing outside it imports it


def module_name(path: Path) -> str:
    """``book/lab.py`` -> ``book.lab``; ``memory/__init__.py`` -> ``memory``."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_path(name: str) -> Path:
    """The file of a module named relative to the package (the inverse of above)."""
    path = PACKAGE.joinpath(*name.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


FILES = sorted(PACKAGE.rglob("*.py"))
# Every module with code of its own: the package's guide and __main__ files aside.
MODULES = sorted(
    module_name(path)
    for path in FILES
    if path != PACKAGE / "__init__.py"
    and path.name != "__main__.py"
    and module_name(path) != BOOK
)


def package_imports(path: Path) -> set[str]:
    """The ``torchbook`` modules that ``path`` imports, named relative to the package.

    ``from torchbook.book import lab`` names ``book.lab``; ``from torchbook.memory
    import TrainingSetup`` names ``memory``. Imports inside functions count too.
    """
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            head, _, rest = node.module.partition(".")
            if head != "torchbook":
                continue
            for alias in node.names:
                inner = f"{rest}.{alias.name}" if rest else alias.name
                if module_path(inner).is_file():
                    names.add(inner)  # "from package import module"
                elif rest:
                    names.add(rest)
        elif isinstance(node, ast.Import):
            names.update(
                alias.name.partition(".")[2]
                for alias in node.names
                if alias.name.startswith("torchbook.")
            )
    return names


def parents(name: str) -> set[str]:
    """The sub-packages whose ``__init__.py`` Python runs before ``name``."""
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def builds_on(name: str) -> set[str]:
    """What a module imports from the package, besides helpers and its own folder's
    ``__init__.py``, which Python runs anyway."""
    return package_imports(module_path(name)) - HELPERS - parents(name) - {BOOK}


def names_module(docstring: str, other: str) -> bool:
    """Whether ``docstring`` names ``torchbook.<other>`` itself, not a module in it."""
    return (
        re.search(rf"torchbook\.{re.escape(other)}(?!\w|\.\w)", docstring) is not None
    )


@pytest.mark.parametrize("module", MODULES)
def test_a_module_builds_on_another_only_where_its_docstring_says_so(module):
    path = module_path(module)
    others = sorted(builds_on(module))
    docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    if others:
        assert "builds on" in docstring, (
            f"{module} imports {others} but its docstring says not what it builds on"
        )
        unnamed = [name for name in others if not names_module(docstring, name)]
        assert not unnamed, (
            f"{module}'s docstring does not name torchbook.{unnamed[0]}, "
            "which it imports"
        )


@pytest.mark.parametrize("path", FILES, ids=lambda path: module_name(path) or "init")
def test_nothing_outside_book_imports_the_books_machinery(path):
    name = module_name(path)
    if name == BOOK or name.startswith(BOOK + "."):
        return
    imported = sorted(
        other
        for other in package_imports(path)
        if other == BOOK or other.startswith(BOOK + ".")
    )
    assert not imported, f"torchbook.{name} imports torchbook.{imported[0]}"


def import_graph() -> dict[str, set[str]]:
    """Each module's imports, the ``__init__.py`` Python runs before it included."""
    graph = {}
    for path in FILES:
        name = module_name(path)
        if name:
            graph[name] = package_imports(path) | parents(name)
    return graph


def test_no_two_modules_import_each_other_even_through_others():
    graph = import_graph()
    done, on_path = set(), []

    def visit(name: str) -> None:
        if name in on_path:
            cycle = [*on_path[on_path.index(name) :], name]
            raise AssertionError("import cycle: " + " -> ".join(cycle))
        if name in done:
            return
        on_path.append(name)
        for other in sorted(graph.get(name, ())):
            visit(other)
        on_path.pop()
        done.add(name)

    for name in sorted(graph):
        visit(name)


def test_the_cycle_check_finds_a_cycle(monkeypatch):
    # The check above must be able to fail: two modules that import each other.
    monkeypatch.setattr(
        sys.modules[__name__],
        "import_graph",
        lambda: {"memory": {"memory.calculator"}, "memory.calculator": {"memory"}},
    )
    with pytest.raises(AssertionError, match="import cycle: memory -> "):
        test_no_two_modules_import_each_other_even_through_others()


# A module a reader can read in one sitting; ruff's formatter (make test) keeps the
# lines honest, so a shorter module is a cut one, never a packed one.
MAX_MODULE_LINES = 500


@pytest.mark.parametrize("path", FILES, ids=lambda path: module_name(path) or "init")
def test_a_module_stays_within_the_lines_a_reader_reads_at_once(path):
    lines = len(path.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_MODULE_LINES, f"{path.relative_to(PACKAGE)} has {lines} lines"


def declared_closure(module: str) -> set[str]:
    """``module``, what it builds on, transitively, the helpers they import and the
    folders' ``__init__.py`` Python runs first.

    What a module builds on is what its docstring declares.
    """
    needed, todo = set(), [module]
    while todo:
        name = todo.pop()
        if name in needed:
            continue
        needed.add(name)
        path = module_path(name)
        docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        declared = {other for other in MODULES if names_module(docstring, other)}
        helpers = package_imports(path) & HELPERS
        todo.extend((declared | helpers | parents(name)) - needed)
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
            target = copied / module_path(name).relative_to(PACKAGE)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(module_path(name).read_text(encoding="utf-8"))
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


GUIDES = (PACKAGE / "__init__.py", PACKAGE / BOOK / "__init__.py")


def package_guide() -> dict[str, set[str]]:
    """What the guides say each module builds on, by its bullet.

    The guides are the docstrings of ``torchbook/__init__.py`` (what readers copy,
    and the memory family) and ``torchbook/book/__init__.py`` (the book's
    machinery). A bullet reads ``- ``name``: what it does (builds on ``a`` and
    ``b``).``, names relative to the package; without "builds on" it declares
    nothing.
    """
    guide = {}
    for path in GUIDES:
        docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        for bullet in re.split(r"\n- ", docstring or "")[1:]:
            name = re.match(r"``([\w.]+)``", bullet)
            if name is None:
                continue
            bullet = " ".join(bullet.split())  # "builds on" may break across lines
            declared = bullet.split("builds on", 1)[1] if "builds on" in bullet else ""
            guide[name.group(1)] = set(re.findall(r"``([\w.]+)``", declared))
    return guide


def test_the_guides_list_every_module():
    guide = package_guide()
    unlisted = [module for module in MODULES if module not in guide]
    assert not unlisted, f"no guide (torchbook/__init__.py, book/) lists {unlisted}"


@pytest.mark.parametrize("module", MODULES)
def test_the_package_guide_names_what_each_module_imports(module):
    # A reader copies a module with what the guide names: it must be exactly what the
    # module imports from the package, besides the two helpers.
    declared = package_guide().get(module, set()) - HELPERS
    assert declared == builds_on(module), (
        f"the guide says {module} builds on {sorted(declared)}; "
        f"it imports {sorted(builds_on(module))}"
    )
