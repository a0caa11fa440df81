"""`dvc repro` end to end at CI size, in a temporary copy of the repository: every stage's
outputs appear, and a second `dvc repro` does nothing."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ARCHIVE = ROOT.parent / "shared" / "data" / "20news-bydate.tar.gz"
STAGES = ("fig1", "fig2", "fig3", "fig4", "fig5", "table1", "fig6", "beyond_lowdim", "beyond_highdim")

pytestmark = pytest.mark.skipif(shutil.which("dvc") is None or not ARCHIVE.is_file(),
                                reason="needs dvc and ../shared/data/20news-bydate.tar.gz")


def run(cmd, cwd):
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout + proc.stderr


def test_dvc_repro_builds_every_artifact_and_then_does_nothing(tmp_path):
    repo = tmp_path / "repo"
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    for name in files:
        if (ROOT / name).is_file() and not name.startswith(("artifacts/", "data/")):
            (repo / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, repo / name)
    (repo / "params.yaml").write_text(
        f"trials: 2\nnewsgroups_trials: 2\narchive: {ARCHIVE}\n"
        "extra: dataset.n_test=8 compute.chunk_trials=2 mlflow.tracking_uri=sqlite:///mlflow.db\n"
    )
    run(["git", "init", "-q"], repo)
    run(["git", "-c", "user.name=ci", "-c", "user.email=ci@example.org", "add", "-A"], repo)
    run(["git", "-c", "user.name=ci", "-c", "user.email=ci@example.org", "commit", "-qm", "copy"], repo)
    first = run(["dvc", "repro"], repo)
    assert "features" in first
    assert (repo / "data/newsgroups/features.npz").is_file()
    for stage in STAGES:
        out = repo / "artifacts" / stage
        assert (out / "results.csv").stat().st_size > 0, stage
        assert "<img" in (out / "report.html").read_text(), stage  # the sweep's report, figures embedded
        metrics = json.loads((out / "metrics.json").read_text())
        assert metrics["trials"] == 2 and metrics["cells"] >= 1, stage
    assert (repo / "artifacts/table1/table.md").is_file()
    assert (repo / "artifacts/fig4/attack_risk.png").is_file()
    second = run(["dvc", "repro"], repo)
    assert "Running stage" not in second, second
    assert "up to date" in second.lower() or "didn't change" in second.lower(), second
    shown = run(["dvc", "metrics", "show"], repo)
    assert "artifacts/fig1/metrics.json" in shown
