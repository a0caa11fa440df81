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


COPIES = {  # a figure in docs/ -> the DVC output it copies
    "docs/dpformer_fig2_grid.png": "artifacts/dpformer_fig2/grid.png",
    "docs/dpformer_fig3.png": "artifacts/dpformer_fig3/efficiency.png",
    "docs/dpformer_curves.png": "artifacts/dpformer_table1/curves.png",
    "docs/dpformer_attention.png": "artifacts/dpformer_table1/attention.png",
    "docs/dpformer_distraction.png": "artifacts/dpformer_distraction/distraction.png",
    "docs/lm_tying.png": "artifacts/lm_tying/perplexity.png",
    "docs/lm_buckets.png": "artifacts/lm_tying/buckets.png",
    "docs/lm_cost.png": "artifacts/lm_cost/cost.png",
}


@pytest.mark.parametrize("copy", sorted(COPIES))
def test_a_figure_copied_into_docs_is_the_artifact_dvc_lock_records(copy):
    """The copy's bytes have the md5 that the committed dvc.lock records for its artifact (a
    fresh clone has no artifacts, the lock has their hashes), and every figure in docs/ is either
    such a copy or not drawn from an artifact at all (screenshots)."""
    import hashlib

    import yaml

    lock = yaml.safe_load((ROOT / "dvc.lock").read_text())
    recorded = {o["path"]: o["md5"] for stage in lock["stages"].values() for o in stage.get("outs", [])}
    assert COPIES[copy] in recorded, f"{COPIES[copy]} is no output in dvc.lock"
    assert hashlib.md5((ROOT / copy).read_bytes()).hexdigest() == recorded[COPIES[copy]], (
        f"{copy} is not the {COPIES[copy]} that dvc.lock records: copy the artifact after its rebuild")
    drawn = {p.relative_to(ROOT).as_posix() for pattern in ("dpformer_*.png", "lm_*.png") for p in (ROOT / "docs").glob(pattern)}
    assert drawn <= set(COPIES), f"figures in docs/ with no recorded artifact: {sorted(drawn - set(COPIES))}"
