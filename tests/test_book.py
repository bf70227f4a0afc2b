"""Fast checks of the book's structure: chapters, cross-references, images, links."""

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


def listed_appendices() -> list[str]:
    return list(book_config()["book"].get("appendices", []))


def book_files() -> list[Path]:
    return [ROOT / name for name in listed_chapters() + listed_appendices()]


def test_every_listed_chapter_exists():
    missing = [name for name in listed_chapters() if not (ROOT / name).is_file()]
    assert not missing, f"_quarto.yml lists files that do not exist: {missing}"


def test_every_listed_appendix_exists():
    missing = [name for name in listed_appendices() if not (ROOT / name).is_file()]
    assert not missing, f"_quarto.yml lists appendices that do not exist: {missing}"


def test_every_appendix_file_is_listed():
    on_disk = {f"appendix/{path.name}" for path in (ROOT / "appendix").glob("*.qmd")}
    unlisted = sorted(on_disk - set(listed_appendices()))
    assert not unlisted, f"appendices missing from _quarto.yml: {unlisted}"


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
    """A chapter's markdown minus inline code: `@fig-x` in backticks is no reference."""
    _, cells = parse_qmd(path)
    return "\n".join(
        INLINE_CODE.sub("", cell.source) for cell in cells if cell.kind == "markdown"
    )


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
                problems.append(
                    f"{path.relative_to(ROOT)}:{cell.line}: {label} has no fig-cap"
                )
    assert not problems, problems


def test_every_image_path_exists():
    missing = []
    for path in filter(Path.is_file, book_files()):
        for target in IMAGE.findall(prose_of(path)):
            if "://" not in target and not (path.parent / target).is_file():
                missing.append(f"{path.relative_to(ROOT)}: {target}")
    assert not missing, f"images that do not exist: {missing}"


@pytest.mark.parametrize(
    "name", [name for name in listed_chapters() if name.startswith("chapters/")]
)
def test_chapter_links_its_notebook_download(name):
    path = ROOT / name
    if not path.is_file():
        pytest.fail(f"{name} is listed but missing")
    meta, _ = parse_qmd(path)
    links = [link.get("href") for link in meta.get("other-links", [])]
    assert f"{path.stem}.ipynb" in links, (
        f"{name}: front matter needs other-links to {path.stem}.ipynb"
    )


# Citations: Quarto's [@key] and narrative @key, in the prose of any page.
BIB_ENTRY = re.compile(r"^@(\w+)\s*\{\s*([^,\s]+)\s*,", re.MULTILINE)
CITATION = re.compile(r"(?<![\w@])@([A-Za-z_][\w-]*(?:[:.][\w-]+)*)")
FENCED_BLOCK = re.compile(r"^(`{3,}|~{3,}).*?^\1", re.MULTILINE | re.DOTALL)
CROSS_REFERENCE_PREFIXES = ("fig-", "sec-", "tbl-", "eq-", "lst-")


def bib_entries() -> dict[str, str]:
    """Key -> entry type of every entry in references.bib."""
    text = (ROOT / "references.bib").read_text(encoding="utf-8")
    return {
        key: kind.lower()
        for kind, key in BIB_ENTRY.findall(text)
        if kind.lower() != "comment"
    }


def pages_that_may_cite() -> list[Path]:
    return sorted(
        [
            *ROOT.glob("*.qmd"),
            *(ROOT / "chapters").glob("*.qmd"),
            *(ROOT / "appendix").glob("*.qmd"),
        ]
    )


def citations_in(path: Path) -> set[str]:
    """Citation keys in prose, not in code cells, fenced examples or inline code."""
    _, cells = parse_qmd(path)
    markdown = "\n".join(cell.source for cell in cells if cell.kind == "markdown")
    # fences first: ``` is not inline code
    prose = INLINE_CODE.sub("", FENCED_BLOCK.sub("", markdown))
    return {
        key
        for key in CITATION.findall(prose)
        if not key.startswith(CROSS_REFERENCE_PREFIXES)
    }


def test_bibliography_is_configured_with_a_references_page():
    assert book_config().get("bibliography") == "references.bib", (
        "_quarto.yml must set bibliography"
    )
    assert "references.qmd" in listed_chapters(), (
        "references.qmd must be listed in the book"
    )
    text = (ROOT / "references.qmd").read_text(encoding="utf-8")
    assert "::: {#refs}" in text, (
        "references.qmd must hold the {#refs} div where Quarto puts the list"
    )


def test_bib_keys_are_unique():
    text = (ROOT / "references.bib").read_text(encoding="utf-8")
    keys = [key for _, key in BIB_ENTRY.findall(text)]
    duplicates = sorted({key for key in keys if keys.count(key) > 1})
    assert not duplicates, f"references.bib defines these keys twice: {duplicates}"


def test_every_bib_entry_names_author_title_and_year_or_url():
    text = (ROOT / "references.bib").read_text(encoding="utf-8")
    starts = [match.start() for match in BIB_ENTRY.finditer(text)] + [len(text)]
    problems = []
    for start, end in zip(starts, starts[1:], strict=False):
        entry = text[start:end]
        key = BIB_ENTRY.match(entry).group(2)
        fields = set(re.findall(r"^\s*(\w+)\s*=", entry, re.MULTILINE))
        if not {"author", "title"} <= fields or not fields & {"year", "url"}:
            problems.append(f"{key}: has {sorted(fields)}")
    assert not problems, (
        f"entries missing author, title, or both year and url: {problems}"
    )


def test_every_citation_key_exists_in_references_bib():
    known = set(bib_entries())
    unknown = [
        f"{path.relative_to(ROOT)}: @{key}"
        for path in pages_that_may_cite()
        for key in sorted(citations_in(path))
        if key not in known
    ]
    assert not unknown, f"citations without an entry in references.bib: {unknown}"


def test_every_bib_entry_is_cited_somewhere():
    cited = set().union(*(citations_in(path) for path in pages_that_may_cite()))
    uncited = sorted(set(bib_entries()) - cited)
    assert not uncited, f"entries in references.bib that no page cites: {uncited}"


def test_citation_finder_sees_brackets_and_narrative_but_not_code_or_references(
    tmp_path,
):
    page = tmp_path / "page.qmd"
    page.write_text(
        "As @kingma2015adam showed [see @loshchilov2019adamw, p. 2; @su2024roformer].\n"
        "See @fig-loss and @sec-intro; mail me at someone@example.org; "
        "`@not_inline`.\n\n"
        "```python\n@torch.no_grad()\ndef f(): ...\n```\n\n"
        "```{python}\n@decorated\ndef g(): ...\n```\n",
        encoding="utf-8",
    )
    assert citations_in(page) == {
        "kingma2015adam",
        "loshchilov2019adamw",
        "su2024roformer",
    }


PAGE_COLUMNS = 88  # ruff's line length: a longer code line wraps in the PDF
# (cell options, `#| fig-cap: ...`, are not shown on the page and may be longer)


@pytest.mark.parametrize("path", book_files(), ids=lambda path: path.name)
def test_no_code_cell_line_is_wider_than_the_page(path):
    wide = [
        f"line {cell.line + offset}: {len(text)} columns"
        for cell in parse_qmd(path)[1]
        if cell.kind == "code"
        for offset, text in enumerate(cell.source.splitlines())
        if len(text) > PAGE_COLUMNS and not text.startswith("#|")
    ]
    assert not wide, f"{path.name}: code lines over {PAGE_COLUMNS} columns: {wide}"
