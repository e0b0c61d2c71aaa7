"""Every relative link in the README and docs/ resolves: the file exists and, when the link
names a heading (`page.md#heading`), that heading exists; docs/index.md lists every page."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def _documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _relative_links(text: str) -> list[str]:
    prose = FENCE.sub("", text)  # code blocks hold brackets that are not links
    return [t for t in LINK.findall(prose) if not re.match(r"[a-z]+:", t)]


def _anchors(markdown: str) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces to '-', repeats numbered."""
    seen: dict[str, int] = {}
    anchors = set()
    for heading in re.findall(r"^#{1,6} (.+)$", FENCE.sub("", markdown), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def broken_links(document: Path) -> list[str]:
    broken = []
    for target in _relative_links(document.read_text()):
        path_part, _, anchor = target.partition("#")
        path = (document.parent / path_part).resolve() if path_part else document
        if not path.exists():
            broken.append(f"{target}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path.read_text()):
            broken.append(f"{target}: no heading #{anchor} in {path.name}")
    return broken


def test_every_relative_link_of_the_readme_and_docs_resolves():
    problems = [
        f"{doc.relative_to(ROOT)}: {problem}"
        for doc in _documents()
        for problem in broken_links(doc)
    ]
    assert not problems, "\n".join(problems)


def test_the_docs_index_links_every_docs_page():
    index = ROOT / "docs" / "index.md"
    linked = {t.partition("#")[0] for t in _relative_links(index.read_text())}
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"index.md"}
    assert sorted(pages - linked) == [], "add these pages to docs/index.md"
    assert "(docs/index.md)" in (ROOT / "README.md").read_text()


def test_the_checker_catches_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "a.md").write_text(
        "# Title\n\n## Two words `code`\n\nsee [b](b.md), [x](#two-words-code), [y](#nope),\n"
        "[web](https://example.com), [z](a.md#title)\n\n```\n[not a link](missing.md)\n```\n"
    )
    assert broken_links(tmp_path / "a.md") == [
        "b.md: no such file",
        "#nope: no heading #nope in a.md",
    ]
