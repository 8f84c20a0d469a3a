"""Every design document the project cites is inside it (``docs/``), and every cited section exists.

A reference is a ``docs/<page>.md`` path, optionally followed by section signs with numbers. A bare section sign
in a source file refers to the nearest page named before it on the same line, else to the first page the file
names (its module docstring's page); in a docs page, to the page linked just before it, else to the page itself.
A section sign right after "paper" or an arXiv id is the paper's own numbering and is not checked. Nothing may
cite the design notes the docs replaced, which live outside the repository.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

from repo_files import tracked_files

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SUFFIXES = (".py", ".md", ".yaml", ".yml")

DOC_PATH = re.compile(r"docs/[A-Za-z0-9_/]+\.md")
DOC_LINK = re.compile(r"\]\(([A-Za-z0-9_./]+\.md)\)")
SECTION = re.compile(r"\u00a7\s*(\d+(?:\.\d+)*)(?:\s*[\u2013-]\s*(\d+(?:\.\d+)*))?")
PAPER = re.compile(r"(?:\bpaper(?:'s)?|arXiv \d{4}\.\d{4,5})\s*$")
HEADING = re.compile(r"^#{1,6}\s+(\d+(?:\.\d+)*)[.\s]")
# What the docs replaced (written in pieces so this file does not cite them itself).
OUTSIDE = (
    "../" + "shared",
    "shared/" + "algorithms",
    "shared/" + "designs",
    "DESIGN" + ".md",
    "specbranch_hsd_" + "selfdraft",
    "specblock_ssd_" + "eagle3",
    "export_" + "contract.md",
)


@functools.cache
def sections(page: Path) -> set[str]:
    """The numbers of a docs page's numbered headings ("## 6. Title", "### 5.1 Title")."""
    return {m.group(1) for line in page.read_text(encoding="utf-8").splitlines() if (m := HEADING.match(line))}


def references(path: Path, text: str) -> list[tuple[int, Path, str | None]]:
    """(line, page, section or None) for every docs reference in ``text``, the file at ``path``."""
    in_docs = DOCS in path.parents
    found = [(i, m) for i, line in enumerate(text.splitlines(), 1) for m in DOC_PATH.finditer(line)]
    primary = ROOT / found[0][1].group(0) if found else None
    refs: list[tuple[int, Path, str | None]] = [(i, ROOT / m.group(0), None) for i, m in found]
    for i, line in enumerate(text.splitlines(), 1):
        if in_docs:
            refs += [(i, (path.parent / m.group(1)).resolve(), None) for m in DOC_LINK.finditer(line)]
        for m in SECTION.finditer(line):
            before = line[: m.start()]
            if PAPER.search(before):
                continue
            page = _page_before(path, before, in_docs, primary)
            refs += [(i, page, number) for number in m.groups() if number]
    return refs


def _page_before(path: Path, before: str, in_docs: bool, primary: Path | None) -> Path:
    if in_docs:
        link = re.search(r"\]\(([A-Za-z0-9_./]+\.md)\)\s*$", before)
        return (path.parent / link.group(1)).resolve() if link else path
    named = DOC_PATH.findall(before)
    if named:
        return ROOT / named[-1]
    if primary is None:
        raise AssertionError(f"{path.relative_to(ROOT)}: a section sign with no docs page named in the file")
    return primary


def problems(path: Path, text: str) -> list[str]:
    """What is wrong with the references in ``text``: missing pages, missing sections, outside documents."""
    where = path.relative_to(ROOT) if ROOT in path.parents else path
    out = [f"{where}: cites {word!r}, a document outside the repository" for word in OUTSIDE if word in text]
    try:
        refs = references(path, text)
    except AssertionError as error:
        return [*out, str(error)]
    for line, page, number in refs:
        if not page.is_file():
            out.append(f"{where}:{line}: {page.relative_to(ROOT) if ROOT in page.parents else page} does not exist")
        elif number is not None and number not in sections(page):
            out.append(f"{where}:{line}: {page.relative_to(ROOT)} has no section {number}")
    return out


def test_every_cited_page_and_section_exists():
    files = [p for p in tracked_files(SUFFIXES) if p != Path(__file__).resolve()]
    assert any(DOCS in p.parents for p in files), "docs/ is not in the file list"
    found = [msg for p in files for msg in problems(p, p.read_text(encoding="utf-8", errors="replace"))]
    assert not found, "\n".join(found)


def test_every_docs_page_is_numbered_and_indexed():
    index = (DOCS / "README.md").read_text(encoding="utf-8")
    for page in sorted(DOCS.rglob("*.md")):
        if page.name == "README.md":
            continue
        assert sections(page), f"{page.relative_to(ROOT)} has no numbered section headings"
        assert str(page.relative_to(DOCS)) in index, f"docs/README.md does not list {page.relative_to(DOCS)}"


@pytest.mark.parametrize(
    "text, wanted",
    [
        ("see docs/numerics.md \u00a799 for more", "has no section 99"),
        ("see docs/nowhere.md", "does not exist"),
        ("Spec: docs/algorithms/ssd.md.\nlater (\u00a77) then (\u00a742)", "has no section 42"),
        ("a bare (\u00a73) with no page", "no docs page named"),
        ("as the DESIGN" + ".md says", "outside the repository"),
    ],
)
def test_the_check_catches_bad_references(text, wanted):
    found = problems(ROOT / "inference" / "example.py", text)
    assert any(wanted in msg for msg in found), found


def test_paper_sections_and_good_references_pass():
    text = (
        "(arXiv 2602.06036 \u00a73.3) and (paper \u00a73)\n"
        "docs/algorithms/specbranch.md \u00a73, \u00a712 item 2; docs/algorithms/verify.md \u00a72\u20133\n(\u00a710)"
    )
    assert problems(ROOT / "inference" / "example.py", text) == []
