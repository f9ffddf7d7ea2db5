"""The README's and docs/' links into the repository lead somewhere: the file exists, and a `#anchor` is a heading of it
(as GitHub makes anchors from headings), so a section moved between pages cannot leave a link behind."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.quick

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)  # a `# comment` in a block is no heading
    return {anchor(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, flags=re.M)}


def test_the_anchor_of_a_heading_is_githubs():
    assert anchor("What `opentau train` does") == "what-opentau-train-does"
    assert anchor("Unattended: automatic restarts") == "unattended-automatic-restarts"
    assert anchor("Export, serve, publish") == "export-serve-publish"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_into_the_repository_leads_to_a_file_and_a_heading_of_it(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):  # https:, mailto:: outside the repository
            continue
        path, _, fragment = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no {file.relative_to(REPO) if file.is_relative_to(REPO) else file}")
        elif fragment and file.suffix == ".md" and fragment not in anchors(file):
            broken.append(f"{target}: no heading #{fragment} in {file.relative_to(REPO)}")
    assert broken == [], f"{page.relative_to(REPO)}: broken links"


def test_every_page_of_docs_is_reached_from_the_readme():
    """Linked from the README, or from a page the README links."""
    readme = (REPO / "README.md").read_text()
    first = {p for p in PAGES[1:] if f"](docs/{p.name}" in readme}
    second = {p for page in first for p in PAGES[1:] if f"]({p.name}" in page.read_text()}
    assert sorted(p.name for p in set(PAGES[1:]) - first - second) == []
