"""Links between the Markdown files of the repository lead somewhere.

Every relative link of README.md, CHANGELOG.md, docs/*.md and the other Markdown files
names a file that exists, and its ``#anchor``, if any, a heading of that file (as GitHub
makes anchors from headings). Links inside code are not links; web links are not fetched.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FILES = sorted(
    [
        ROOT / "README.md",
        ROOT / "CHANGELOG.md",
        *(ROOT / "docs").glob("*.md"),
        *(ROOT / "bench").glob("*.md"),
        *(ROOT / "tests").rglob("*.md"),
        *(ROOT / "examples").rglob("*.md"),
    ]
)
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^\s*>?\s*```")


def _prose(path: Path) -> list[tuple[int, str]]:
    """The lines outside fenced code, with inline code spans blanked, by line number."""
    lines: list[tuple[int, str]] = []
    fenced = False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, re.sub(r"`[^`]*`", "``", line)))
    return lines


def anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown file (repeats get -1, -2...)."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    fenced = False
    for line in path.read_text().splitlines():
        if _FENCE.match(line):
            fenced = not fenced
        if fenced or not line.startswith("#"):
            continue
        text = line.lstrip("#").strip().lower()
        slug = re.sub(r"[^\w\- ]", "", text).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def _broken(path: Path, root: Path = ROOT) -> list[str]:
    broken: list[str] = []
    for number, line in _prose(path):
        for target in _LINK.findall(line):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            name, _, anchor = target.partition("#")
            dest = (path.parent / name).resolve() if name else path
            where = f"{path.relative_to(root)}:{number}: {target}"
            if not dest.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{where} (no such heading)")
    return broken


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(ROOT)) for p in FILES])
def test_doc_links_lead_somewhere(path: Path) -> None:
    assert _broken(path) == []


def test_doc_links_checker_finds_a_broken_link(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n\n## A section, here\n\n[ok](#a-section-here) [file](page.md#title)\n"
        "[gone](missing.md) [bad](#nowhere) `[code](missing.md)`\n"
        "```text\n[fenced](missing.md)\n```\n"
    )
    assert _broken(page, tmp_path) == [
        "page.md:6: missing.md (no such file)",
        "page.md:6: #nowhere (no such heading)",
    ]
