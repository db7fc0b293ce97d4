"""Every relative link of README.md and docs/*.md resolves: its file exists and its anchor is a
heading of that file (as GitHub makes anchors of headings). A link that goes nowhere is a
promise of the docs nobody checks; operators.md linked #kill-reasons before it existed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.MULTILINE | re.DOTALL)
CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", re.MULTILINE)
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.IGNORECASE)


def prose(text: str) -> str:
    """The text with code blocks and inline code blanked out: links and headings in them are
    not links or headings."""
    return CODE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its rendered text, lower case, punctuation dropped,
    spaces made hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = path.read_text()
    found: set[str] = set(HTML_ANCHOR.findall(text))
    seen: dict[str, int] = {}
    for heading in HEADING.findall(FENCE.sub("", text)):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(path: Path) -> list[str]:
    return LINK.findall(prose(path.read_text()))


def test_the_checks_own_rules() -> None:
    assert slug("One step, one worker: the lease's timeline") == (
        "one-step-one-worker-the-leases-timeline"
    )
    assert slug("The `cyclone` command") == "the-cyclone-command"
    assert slug("Connections and [PgBouncer](https://x)") == "connections-and-pgbouncer"
    assert links_of("see [a](#b) and [c](d.md#e \"t\") but not `[f](g)` nor ![i](j.png)") == [
        "#b", "d.md#e",
    ]  # fmt: skip


def links_of(text: str) -> list[str]:
    return LINK.findall(prose(text))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(doc: Path) -> None:
    broken = []
    for target in links(doc):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not ours to check
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            broken.append(f"{target}: no file {path}")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading #{anchor} in {file.relative_to(ROOT)}")
    assert broken == [], f"{doc.relative_to(ROOT)}: broken links"


def test_the_docs_have_links_to_check() -> None:
    # The check above must not pass because it found nothing.
    assert sum(len(links(d)) for d in DOCS) > 20
    assert any("#" in t for d in DOCS for t in links(d))
