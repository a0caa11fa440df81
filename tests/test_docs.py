"""README and docs/*.md: every relative link reaches a file that exists and, with a #fragment, a
heading of that file (GitHub's anchors), so that moving a section cannot leave a dead link."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]


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


def test_the_docs_index_links_every_docs_page_and_readme_links_the_index():
    """README links docs/README.md (the index) and CHANGELOG.md; the index links every other page of
    docs/ (issue 63: README linked each page itself, among 571 lines)."""
    readme = (ROOT / "README.md").read_text()
    assert "](docs/README.md)" in readme and "](CHANGELOG.md)" in readme
    index = (ROOT / "docs" / "README.md").read_text()
    for page in sorted((ROOT / "docs").glob("*.md")):
        if page.name != "README.md":
            assert f"]({page.name})" in index, page.name


def test_readme_is_one_screen_about_the_present_and_starts_with_two_commands():
    """Issue 63: README was 571 lines carrying every release's history. It is at most 200 lines, its
    first bash block holds exactly the two commands .ci/run runs, it keeps the sections a newcomer
    needs, and the phrases that told history are gone (they live in CHANGELOG.md)."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200, len(readme.splitlines())
    block = readme.split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [line.split("#")[0].strip() for line in block.splitlines() if line.split("#")[0].strip()]
    assert commands == ['python3 -m venv .venv && . .venv/bin/activate && pip install -e ".[dev]" && python -m pipeline',
                        '. .venv/bin/activate && python -m pytest -m "not slow" -n auto --dist loadgroup'], commands
    assert "../shared" in block.splitlines()[0]  # where the data and the papers come from, before anything runs
    ci = (ROOT / ".ci" / "run").read_text()  # CI runs the rest: every test runs somewhere
    assert "python -m pytest -m slow -n auto --dist loadgroup" in ci
    headings = re.findall(r"^## (.+)$", readme, re.M)
    assert headings == ["A five-minute tour", "Results at a glance", "Where to read more", "Privacy assumptions"], headings
    for past in ("this release", "Before this", "until this", "earlier release", "used to"):
        assert past.lower() not in readme.lower(), past


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


def test_the_stages_a_fresh_clones_status_calls_deleted_are_those_docs_name():
    """A fresh clone has no DVC cache: ``dvc status`` lists every output as not in cache and, for a
    stage that depends on another stage's output, that dependency as ``deleted`` (issue 63: README
    said every stage was up to date). docs/dvc.md names those stages and the outputs they wait for;
    this keeps its table equal to dvc.yaml's."""
    import yaml

    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]

    def path(entry) -> str:
        return next(iter(entry)) if isinstance(entry, dict) else entry

    made = {path(o): name for name, stage in stages.items() for o in stage.get("outs", [])}
    waiting = {(name, dep, made[dep]) for name, stage in stages.items() for dep in map(path, stage.get("deps", []))
               if dep in made}
    page = (ROOT / "docs" / "dvc.md").read_text()
    rows = set(re.findall(r"^\| `([a-z0-9_]+)` \| `([^`]+)` \| `([a-z0-9_]+)` \|$", page, re.M))
    assert waiting == rows and len(rows) == 5, (waiting, rows)
