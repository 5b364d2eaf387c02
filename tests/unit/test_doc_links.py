"""Links between the repository's Markdown files land on a heading (or an explicit ``<a id>``)
of the file they name, as GitHub renders it."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\]\(((?!https?:|mailto:)[^)#\s]*\.md)#([^)\s]+)\)")


def anchors(text: str) -> set[str]:
    """GitHub's anchors of ``text``: each heading lower-cased, punctuation but ``-`` and ``_``
    dropped, spaces to ``-`` (so ``Long inferences — F17`` is ``long-inferences--f17``), and every
    ``<a id="…">``."""
    out = set(re.findall(r'<a (?:id|name)="([^"]+)"', text))
    for line in text.splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def markdown_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def test_every_anchor_link_between_markdown_files_resolves():
    broken = []
    for source in markdown_files():
        for target, anchor in LINK.findall(source.read_text()):
            path = (source.parent / target).resolve()
            if not path.exists() or anchor not in anchors(path.read_text()):
                broken.append(f"{source.relative_to(REPO)}: {target}#{anchor}")
    assert broken == []


def test_the_anchor_rule_reads_a_dash_in_a_heading_as_github_does():
    assert anchors("## Long inferences — F17\n") == {"long-inferences--f17"}
