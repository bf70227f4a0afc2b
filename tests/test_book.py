"""Fast checks of the book's structure: chapters, cross-references, images, notebook links."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from qmd_notebook import parse_qmd  # noqa: E402

CROSS_REFERENCE = re.compile(r"(?<![\w@])@((?:fig|tbl|sec|eq|lst)-[\w-]+)")
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)")
HEADING_LABEL = re.compile(r"\{#((?:sec|fig|tbl|eq)-[\w-]+)[^}]*\}")
INLINE_CODE = re.compile(r"`[^`\n]*`")


def book_config() -> dict:
    return yaml.safe_load((ROOT / "_quarto.yml").read_text(encoding="utf-8"))


def listed_chapters() -> list[str]:
    entries = []
    for entry in book_config()["book"]["chapters"]:
        if isinstance(entry, dict):  # a part: {part: ..., chapters: [...]}
            entries += entry.get("chapters", [])
        else:
            entries.append(entry)
    return entries


def book_files() -> list[Path]:
    return [ROOT / name for name in listed_chapters()]


def test_every_listed_chapter_exists():
    missing = [name for name in listed_chapters() if not (ROOT / name).is_file()]
    assert not missing, f"_quarto.yml lists files that do not exist: {missing}"


def test_every_chapter_file_is_listed():
    on_disk = {f"chapters/{path.name}" for path in (ROOT / "chapters").glob("*.qmd")}
    unlisted = sorted(on_disk - set(listed_chapters()))
    assert not unlisted, f"chapters missing from _quarto.yml: {unlisted}"


def labels_in(path: Path) -> set[str]:
    meta, cells = parse_qmd(path)
    labels = set()
    for cell in cells:
        if cell.kind == "code" and "label" in cell.options:
            labels.add(str(cell.options["label"]))
        if cell.kind == "markdown":
            labels.update(HEADING_LABEL.findall(cell.source))
    return labels


def prose_of(path: Path) -> str:
    """The markdown of a chapter without inline code, so `@fig-x` in backticks is not a reference."""
    _, cells = parse_qmd(path)
    return "\n".join(INLINE_CODE.sub("", cell.source) for cell in cells if cell.kind == "markdown")


def test_every_cross_reference_has_its_label():
    files = [path for path in book_files() if path.is_file()]
    labels = set().union(*(labels_in(path) for path in files))
    dangling = [
        f"{path.relative_to(ROOT)}: @{ref}"
        for path in files
        for ref in CROSS_REFERENCE.findall(prose_of(path))
        if ref not in labels
    ]
    assert not dangling, f"references without a label: {dangling}"


def test_every_figure_label_has_a_caption():
    problems = []
    for path in filter(Path.is_file, book_files()):
        for cell in parse_qmd(path)[1]:
            label = str(cell.options.get("label", "")) if cell.kind == "code" else ""
            if label.startswith("fig-") and not cell.options.get("fig-cap"):
                problems.append(f"{path.relative_to(ROOT)}:{cell.line}: {label} has no fig-cap")
    assert not problems, problems


def test_every_image_path_exists():
    missing = []
    for path in filter(Path.is_file, book_files()):
        for target in IMAGE.findall(prose_of(path)):
            if "://" not in target and not (path.parent / target).is_file():
                missing.append(f"{path.relative_to(ROOT)}: {target}")
    assert not missing, f"images that do not exist: {missing}"


@pytest.mark.parametrize("name", [name for name in listed_chapters() if name.startswith("chapters/")])
def test_chapter_links_its_notebook_download(name):
    path = ROOT / name
    if not path.is_file():
        pytest.fail(f"{name} is listed but missing")
    meta, _ = parse_qmd(path)
    links = [link.get("href") for link in meta.get("other-links", [])]
    assert f"{path.stem}.ipynb" in links, f"{name}: front matter needs other-links to {path.stem}.ipynb"
