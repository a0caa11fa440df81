"""README and docs/*.md: every relative link reaches a file that exists and, with a #fragment, a
heading of that file (GitHub's anchors), so that moving a section cannot leave a dead link."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (not - or _), spaces to -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # headings only, not code
    return {anchor(line.lstrip("#")) for line in text.splitlines() if re.match(r"#{1,6} ", line)}


def links(page: Path):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if not re.match(r"[a-z]+://", target):
            yield target


def test_anchor_rule_on_known_headings():
    assert anchor("GPUs (`compute.device`)") == "gpus-computedevice"
    assert anchor("Step benchmark (`python -m benchmarks.seqrec_step`)") == "step-benchmark-python--m-benchmarksseqrec_step"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_and_anchor_exists(page):
    dead = []
    for target in links(page):
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            dead.append(target)
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            dead.append(target)
    assert not dead, f"{page.name}: dead links {dead}"


def test_readme_links_every_docs_page():
    readme = (ROOT / "README.md").read_text()
    for page in PAGES[1:]:
        assert f"docs/{page.name}" in readme, page.name
