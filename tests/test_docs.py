"""The front door: the README stays a short user's guide, every relative link in the docs points
at a file that exists (and a heading that exists, where it names one), docs/README.md indexes
every page of docs/, and the LICENSE the package declares is there."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README_MAX_LINES = 250
README_MAX_CHARS = 20_000
LINKED_DOCS = [
    "README.md",
    "reports/README.md",
    "analysis/README.md",
    *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md")),
]
LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def prose(text: str) -> str:
    """`text` without fenced code blocks and inline code, where `[x](y)` is code, not a link."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def links(text: str) -> list[str]:
    return LINK.findall(prose(text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, inline code unwrapped, punctuation dropped,
    spaces to hyphens."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", text, flags=re.M):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def test_slug_is_githubs():
    assert slug("The collapse demo (`make demo`)") == "the-collapse-demo-make-demo"
    assert slug("Quick start: the collapse demo") == "quick-start-the-collapse-demo"
    assert slug("License and citation") == "license-and-citation"


def test_links_skip_code():
    text = "[a](x.md) `[b](y.md)` and\n```python\nDRAW['k'](df)\n```\n![c](z.png)"
    assert links(text) == ["x.md", "z.png"]


@pytest.mark.parametrize("doc", LINKED_DOCS)
def test_every_relative_link_resolves(doc):
    path = REPO / doc
    broken = []
    for target in links(path.read_text()):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no such heading)")
    assert broken == [], f"{doc}: broken links"


def test_readme_is_a_short_guide():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    assert len(text) <= README_MAX_CHARS
    # a newcomer finds these in the first 120 lines
    head = "\n".join(text.splitlines()[:120])
    for needle in ["## Install", "make demo", "model.path=", "omgrpo sweep", "jupyter lab"]:
        assert needle in head, needle


def test_docs_index_links_every_page():
    index = REPO / "docs" / "README.md"
    linked = {(index.parent / t.partition("#")[0]).resolve() for t in links(index.read_text())}
    pages = {p.resolve() for p in (REPO / "docs").glob("*.md")} - {index.resolve()}
    assert sorted(p.name for p in pages - linked) == []


def test_no_references_to_an_issue_tracker_outside_the_repo():
    """'issue 29' meant something only to whoever could read that tracker: say why instead."""
    for doc in LINKED_DOCS:
        found = re.findall(r"\bissues? #?\d+", (REPO / doc).read_text(), flags=re.I)
        assert found == [], doc


def test_license_is_the_apache_license_the_package_declares():
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert "END OF TERMS AND CONDITIONS" in text
    assert re.search(r"^license\s*=.*Apache-2\.0", (REPO / "pyproject.toml").read_text(), re.M)
