"""`dvc repro` end to end at CI size, in a temporary copy of the repository: every stage's
outputs appear, and a second `dvc repro` does nothing."""

import json
import os
import shutil
import subprocess
from pathlib import Path

import forkserver
import pandas as pd
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
ARCHIVE = ROOT.parent / "shared" / "data" / "20news-bydate.tar.gz"
AMAZON = ROOT.parent / "shared" / "data" / "amazon-games-sasrec.txt"
STAGES = ("fig1", "fig2", "fig3", "fig4", "fig5", "table1", "fig6", "beyond_lowdim", "beyond_highdim")
DPFORMER = ("dpformer_fig2", "dpformer_table1", "dpformer_fig7", "dpformer_table2")
LM = ("lm_tying", "lm_cost", "lm_audit_run", "lm_pretrain", "lm_finetune")
PREFIXES = {"dpformer": "dpformer_", "lm": "lm_"}  # a stage's task by its name; NoisyHead's have no prefix

pytestmark = pytest.mark.skipif(shutil.which("dvc") is None or not ARCHIVE.is_file() or not AMAZON.is_file(),
                                reason="needs dvc, ../shared/data/20news-bydate.tar.gz and amazon-games-sasrec.txt")


def run(cmd, cwd, env=None):
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=1800, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout + proc.stderr


LM_SPLIT_SHAPE = ("dataset.posts=60 dataset.eval_posts=10 dataset.L=8 vocab.size=300 model.d=8 model.layers=1 "
                  "model.heads=2 train.batch_size=20 train.epochs=1 train.validate_every=1 "
                  "mlflow.tracking_uri=sqlite:///mlflow.db")  # lm_pretrain's and lm_finetune's CI size


def _copy(tmp_path) -> Path:
    """A git repository holding the working tree's files (no artifacts) and CI-sized params.yaml."""
    repo = tmp_path / "repo"
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    for name in files:
        if (ROOT / name).is_file() and not name.startswith(("artifacts/", "data/")):
            (repo / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, repo / name)
    # CI size: two trials, one seed, one epoch, one DPFormer batch size (the tuning grids keep their learning
    # rates: each table must still run each model at the setting tuned for it), tiny models and data; one
    # job (joblib in the stage's process): at this size a cell trains in well under a second, and each of
    # joblib's two workers imports torch and MLflow and calibrates DP-SGD's noise again for every sweep
    # (idle 2-core machine: DPFormer's stages 194 s of wall and CPU with one job against 318 s of wall and
    # 421 s of CPU with two; the language model's 111 s of CPU against 158 s). Parallel cells are
    # tested in tests/test_sweeps.py; here the wiring of dvc.yaml.
    (repo / "params.yaml").write_text(
        f"trials: 2\nnewsgroups_trials: 2\narchive: {ARCHIVE}\ndevice: cpu\n"
        "extra: dataset.n_test=8 compute.chunk_trials=2 mlflow.tracking_uri=sqlite:///mlflow.db\n"
        f"amazon: {AMAZON}\ndpformer_synthetic_data: synthetic_longtail_tiny\ndpformer_amazon_data: amazon_games_tiny\n"
        "dpformer_jobs: 1\ndpformer_device: cpu\ndpformer_extra: seed=0 seqrec.epochs=1 seqrec.batch_size=128 model.d=8 model.d_ff=16 "
        "mlflow.tracking_uri=sqlite:///mlflow.db\ndpformer_fig3_grid: --B 2 --L 4 --M 20 --repeats 1\n"
        "dpformer_audit_seeds: 0\ndpformer_audit_m: 200\ndpformer_audit_input_m: 20\ndpformer_audit_extra: seqrec.epochs=2 seqrec.batch_size=50 "
        "model.d=8 model.d_ff=16 mlflow.tracking_uri=sqlite:///mlflow.db\n"
        "lm_jobs: 1\nlm_device: cpu\nlm_extra: dataset.posts=60 dataset.eval_posts=10 dataset.L=8 vocab.size=300 "
        "model.d=8 model.layers=1 model.heads=2 train.batch_size=20 train.epochs=1 train.validate_every=1 "
        "privacy.eps=1,inf seed=0,1 mlflow.tracking_uri=sqlite:///mlflow.db\n"
        "lm_cost_grid: --V 300 600 --B 2 --L 4 --d 8 --layers 1 --heads 2 --repeats 1\n"
        "lm_audit_seeds: 0\nlm_audit_m: 200\nlm_audit_input_m: 20\nlm_audit_extra: dataset.posts=60 dataset.eval_posts=10 dataset.L=8 "
        "vocab.size=300 model.d=8 model.layers=1 model.heads=2 train.batch_size=20 train.epochs=2 "
        "mlflow.tracking_uri=sqlite:///mlflow.db\n"
        f"lm_pretrain_extra: {LM_SPLIT_SHAPE}\n"  # the fine-tuning's shape must be the pretraining's: one string for both
        f"lm_finetune_extra: {LM_SPLIT_SHAPE} privacy.eps=8,inf seed=0,1\n"
    )
    run(["git", "init", "-q"], repo)
    run(["git", "-c", "user.name=ci", "-c", "user.email=ci@example.org", "add", "-A"], repo)
    run(["git", "-c", "user.name=ci", "-c", "user.email=ci@example.org", "commit", "-qm", "copy"], repo)
    return repo


def _noisyhead_artifacts(repo: Path, first: str) -> None:
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


def _dpformer_artifacts(repo: Path) -> None:
    for stage in DPFORMER:  # the DPFormer paper's tables and figures (one seed, one epoch here)
        out = repo / "artifacts" / stage
        assert "<img" in (out / "report.html").read_text(), stage
        assert "| transformer |" in (out / "table.md").read_text(), stage
        assert json.loads((out / "metrics.json").read_text())["cells"] >= 2, stage
        assert (out / "curves.png").stat().st_size > 0, stage
    for grid, tab in (("dpformer_fig2", "dpformer_table1"), ("dpformer_fig7", "dpformer_table2")):
        assert (repo / "artifacts" / grid / "selected.txt").read_text().startswith("seqrec.lr="), grid
        tuned = yaml.safe_load((repo / "artifacts" / grid / "tuned.yaml").read_text())  # each model's, on validation
        ran = pd.read_csv(repo / "artifacts" / tab / "results.csv").groupby("model")[["lr", "batch_size"]].first()
        assert set(ran.index) <= set(tuned) and len(ran) == 6, (grid, sorted(tuned))
        for model, row in ran.iterrows():  # the table ran each model at its own tuned setting
            assert (row["lr"], row["batch_size"]) == (tuned[model]["lr"], tuned[model]["batch_size"]), (tab, model)
    assert (repo / "artifacts/dpformer_fig3/efficiency.png").stat().st_size > 0
    assert len(json.loads((repo / "artifacts/dpformer_fig3/efficiency.json").read_text())) == 4  # one row per engine
    page = (repo / "artifacts/dpformer_table1/report.html").read_text()  # the paired gains and verdicts, figures captioned
    assert "<p>Re-Attention&#x27;s relative gain in test NDCG@10" in page and "<th>verdict</th>" in page
    assert "<figcaption>curves.png: validation NDCG@10 (top) and HIT@10 (bottom, %) per epoch" in page
    table1 = (repo / "artifacts/dpformer_table1/results.csv").read_text()
    assert "attention_relevant" in table1 and "eps" in table1
    assert "non-private" in (repo / "artifacts/dpformer_table2/nonprivate/table.md").read_text()
    ablation = pd.read_csv(repo / "artifacts/dpformer_ablation/results.csv")  # Re-Attention's form x errors x blocks
    every_block = {"dpformer:presence-public", "dpformer:presence-public:form-paper", "dpformer:presence-public:form-off",
                   "dpformer:errors-adam", "dpformer:form-paper:errors-adam", "dpformer:form-off:errors-adam"}
    assert set(ablation["model"]) == every_block | {f"{name}:blocks-2" for name in every_block}
    tuned = yaml.safe_load((repo / "artifacts/dpformer_fig2/tuned.yaml").read_text())["dpformer:presence-public"]
    assert set(zip(ablation["lr"], ablation["batch_size"])) == {(tuned["lr"], tuned["batch_size"])}  # not tuned apart
    gains = pd.read_csv(repo / "artifacts/dpformer_ablation/gains.csv")  # over form-off; its controls left out
    assert len(gains) == 8 * 2 and not any("form-off" in v for v in gains["variant"])
    trained = ablation[(ablation["split"] == "test") & (ablation["method"] == ablation["model"])]
    test = trained.set_index(["model", "eps", "seed"])["ndcg10"]
    reference = test.xs("dpformer:presence-public:form-off")
    for control in ("dpformer:form-off:errors-adam", "dpformer:presence-public:form-off:blocks-2",
                    "dpformer:form-off:errors-adam:blocks-2"):  # without correction, errors and blocks do nothing:
        assert test.xs(control).equals(reference), control  # the same training, bit for bit
    # the whole-run audits, one seed here: eps = 1 and its seven variants, eps = 8, three of input canaries
    audit = pd.read_csv(repo / "artifacts/dpformer_audit_run/audit.csv")
    assert len(audit) == 11 and list(audit["canaries"]).count("input") == 3 and set(audit["m"]) == {200, 20}
    assert set(audit["claim"]) == {1.0, 8.0} and set(audit["seed"]) == {0}
    assert (audit["eps_lower"] <= audit["eps_ceiling"]).all() and audit["verdict"].notna().all()
    assert "| 1 | tied | one_branch | dirac | 200 | 1 |" in (repo / "artifacts/dpformer_audit_run/audit.md").read_text()
    assert len(list((repo / "artifacts/dpformer_audit_run/runs").glob("*/runs/*.png"))) == 11
    distraction = repo / "artifacts/dpformer_distraction"  # the distraction measurement (pipeline/seqrec/distraction.py)
    assert "| paper | 8 |" in (distraction / "table.md").read_text()
    assert "paper.eps8.corrected.tail" in json.loads((distraction / "metrics.json").read_text())
    assert (distraction / "distraction.png").stat().st_size > 0


def _lm_artifacts(repo: Path) -> None:
    out = repo / "artifacts/lm_tying"  # tied and untied, eps 1 and non-private, two seeds, two learning rates
    assert "<img" in (out / "report.html").read_text()
    gains = pd.read_csv(out / "gains.csv")
    verdicts = gains.set_index("eps")["verdict"]
    assert len(gains) == 2 and verdicts[float("inf")] == "no DP-SGD"  # no noise: no verdict on DP-SGD
    assert verdicts[1.0] in {"reproduced", "contradicted", "inconclusive"}
    assert set(pd.read_csv(out / "buckets.csv")["bucket"]) == {"head", "torso", "tail"}
    assert len(pd.read_csv(out / "grid.csv")) == 4  # each model at each eps, its learning rate
    assert json.loads((out / "metrics.json").read_text())["cells"] == 16
    cost = json.loads((repo / "artifacts/lm_cost/cost.json").read_text())
    assert len(cost) == 12 and all("error" not in r for r in cost)  # six engines and tyings at two V
    assert (repo / "artifacts/lm_cost/cost.png").stat().st_size > 0
    # the whole-run audits, one seed here: eps = 1 and its six variants, eps = 8 tied and untied, two of input canaries
    audit = pd.read_csv(repo / "artifacts/lm_audit_run/audit.csv")
    assert len(audit) == 10 and list(audit["canaries"]).count("input") == 2 and set(audit["m"]) == {200, 20}
    assert set(zip(audit["claim"], audit["model"])) == {(1.0, "tied"), (8.0, "tied"), (8.0, "untied")}
    assert (audit["eps_lower"] <= audit["eps_ceiling"]).all() and audit["verdict"].notna().all()
    table = (repo / "artifacts/lm_audit_run/audit.md").read_text()
    assert "| 1 | tied | resume_reuses_noise | dirac | 200 | 1 |" in table and "| 8 | untied | engine | dirac | 200 | 1 |" in table
    assert len(list((repo / "artifacts/lm_audit_run/runs").glob("*/runs/*.png"))) == 10
    summary = json.loads((repo / "artifacts/lm_audit_run/metrics.json").read_text())  # flagged: proofs only, estimates beside
    assert {f"eps1.tied.no_noise.dirac.{k}" for k in ("flagged", "steinke_proofs", "fdp_proofs", "estimates_above")} <= set(summary)
    # issue 65: the public groups' pretraining (tied and untied, each vocabulary), then DP fine-tuning from each
    models = sorted(p.name for p in (repo / "artifacts/lm_pretrain/models").iterdir())
    assert models == ["private_groups-tied.pt", "private_groups-untied.pt", "public_groups-tied.pt",
                      "public_groups-untied.pt"], models
    pretrain = pd.read_csv(repo / "artifacts/lm_pretrain/results.csv")
    assert set(pretrain["part"]) == {"public"} and set(pretrain["eps"]) == {float("inf")} and len(pretrain.groupby(
        ["vocab", "tying"])) == 4
    out = repo / "artifacts/lm_finetune"  # two vocabularies x tied and untied x eps 8 and inf x two learning rates x two seeds
    assert json.loads((out / "metrics.json").read_text())["cells"] == 32
    results = pd.read_csv(out / "results.csv")
    assert set(results["part"]) == {"private"} and "pretrained" in set(results["method"])
    gains = pd.read_csv(out / "gains.csv")
    assert len(gains) == 4 and set(gains[gains["eps"] == 8.0]["verdict"]) <= {"reproduced", "contradicted", "inconclusive"}
    checks = pd.read_csv(out / "checks.csv")  # each vocabulary, eps and model against the public-only and unigram models
    assert len(checks) == 16 and set(checks["reference"]) == {"public-only", "unigram"}
    assert set(checks["verdict"]) <= {"beats", "does not beat", "inconclusive"}
    table = (out / "table.md").read_text()
    assert "| public-only (tied) (vocab=public_groups) |" in table and table.count("- **The setting (vocab=") == 2
    assert len(pd.read_csv(out / "grid.csv")) == 8 and set(pd.read_csv(out / "buckets.csv")["bucket"]) == {"head", "torso", "tail"}
    assert "vocab_public_groups.check.large_enough" in json.loads((out / "metrics.json").read_text())


def _stages(task: str) -> list[str]:
    """Every stage of dvc.yaml of one task (NoisyHead's, features included, DPFormer's or the
    language model's): the parts share no stage and no dependency, so each is rebuilt in a copy of
    its own, side by side under pytest-xdist."""
    names = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    if task == "noisyhead":
        return [n for n in names if not n.startswith(tuple(PREFIXES.values()))]
    return [n for n in names if n.startswith(PREFIXES[task])]


@pytest.mark.slow
@pytest.mark.parametrize("task", ["dpformer", "noisyhead", "lm"])  # longest first (tests/conftest.py starts these first)
def test_dvc_repro_builds_every_artifact_and_then_does_nothing(tmp_path, task):
    """Each stage's ``python -m`` is forked from the test worker's fork server (``forkserver.on_path``:
    a ``python`` first on DVC's PATH relays it), as the command-line tests' are: about 7 s of imports
    a stage otherwise (what a stage's process imports, in a fresh interpreter: the test below)."""
    repo = _copy(tmp_path)
    stages = _stages(task)
    with forkserver.on_path() as python:
        first = run(["dvc", "repro", *stages], repo, env=dict(os.environ, PATH=f"{python}{os.pathsep}{os.environ['PATH']}"))
    if task == "noisyhead":
        _noisyhead_artifacts(repo, first)
    elif task == "dpformer":
        _dpformer_artifacts(repo)
    else:
        _lm_artifacts(repo)
    second = run(["dvc", "repro", *stages], repo)
    assert "Running stage" not in second, second
    assert "up to date" in second.lower() or "didn't change" in second.lower(), second
    shown = run(["dvc", "metrics", "show"], repo)
    assert {"noisyhead": "artifacts/fig1/metrics.json", "dpformer": "artifacts/dpformer_table1/metrics.json",
            "lm": "artifacts/lm_tying/metrics.json"}[task] in shown


def test_the_parts_of_the_rebuild_cover_every_stage_and_share_none():
    """The end-to-end test rebuilds NoisyHead's, DPFormer's and the language model's stages apart:
    each part must be closed under dependencies (no stage of one reads an output of another) and
    together they are dvc.yaml's every stage."""
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    halves = [set(_stages("noisyhead")), set(_stages("dpformer")), set(_stages("lm"))]
    assert set.union(*halves) == set(stages) and sum(map(len, halves)) == len(stages)
    assert set(STAGES) | {"features"} <= halves[0] and set(DPFORMER) <= halves[1] and set(LM) == halves[2]
    for half in halves:
        made = {str(o if isinstance(o, str) else next(iter(o))) for n in half for o in stages[n].get("outs", [])}
        other = {str(o if isinstance(o, str) else next(iter(o))) for n in stages if n not in half
                 for o in stages[n].get("outs", [])}
        for name in half:
            for dep in stages[name].get("deps", []):
                assert not any(dep == o or dep.startswith(o.rstrip("/") + "/") for o in other), (name, dep)
        assert made


LOADS = {  # what a stage's process imports: its entry points and the modules its task loads on demand
    "fig1": ["pipeline.__main__", "pipeline.tasks", "pipeline.overrides", "pipeline.preflight", "pipeline.sweep",
             "pipeline.noisyhead.task", "pipeline.noisyhead.cell", "pipeline.noisyhead.memory",
             "pipeline.noisyhead.sweep", "pipeline.noisyhead.newsgroups",
             "hydra_plugins.pipeline_sweeper.validating_sweeper", "hydra_plugins.pipeline_sweeper.searchpath"],
    "dpformer_table2": ["pipeline.__main__", "pipeline.tasks", "pipeline.overrides", "pipeline.preflight",
                        "pipeline.sweep", "pipeline.seqrec.task", "pipeline.seqrec.cell", "pipeline.seqrec.sweep",
                        "pipeline.seqrec.config", "pipeline.seqrec.synthetic",
                        "hydra_plugins.pipeline_sweeper.validating_sweeper", "hydra_plugins.pipeline_sweeper.searchpath"],
    "dpformer_ablation": ["pipeline.__main__", "pipeline.tasks", "pipeline.overrides", "pipeline.preflight",
                          "pipeline.sweep", "pipeline.seqrec.task", "pipeline.seqrec.cell", "pipeline.seqrec.sweep",
                          "pipeline.seqrec.config", "pipeline.seqrec.synthetic", "pipeline.seqrec.tuning",
                          "hydra_plugins.pipeline_sweeper.validating_sweeper", "hydra_plugins.pipeline_sweeper.searchpath"],
    "dpformer_distraction": ["pipeline.seqrec.distraction", "pipeline.tasks", "pipeline.overrides", "pipeline.preflight",
                             "pipeline.sweep", "pipeline.seqrec.task", "pipeline.seqrec.config", "pipeline.seqrec.data",
                             "pipeline.seqrec.plot", "hydra_plugins.pipeline_sweeper.validating_sweeper",
                             "hydra_plugins.pipeline_sweeper.searchpath"],
    "dpformer_fig3": ["benchmarks.seqrec_step", "pipeline.seqrec.clipping", "pipeline.seqrec.models",
                      "pipeline.seqrec.train"],
    "lm_tying": ["pipeline.__main__", "pipeline.tasks", "pipeline.overrides", "pipeline.preflight", "pipeline.sweep",
                 "pipeline.lm.task", "pipeline.lm.cell", "pipeline.lm.sweep", "pipeline.lm.config",
                 "pipeline.lm.prepare", "pipeline.lm.memory", "pipeline.lm.engines", "pipeline.clipping",
                 "pipeline.clipping.opacus", "hydra_plugins.pipeline_sweeper.validating_sweeper",
                 "hydra_plugins.pipeline_sweeper.searchpath"],
    "lm_pretrain": ["pipeline.__main__", "pipeline.tasks", "pipeline.overrides", "pipeline.preflight", "pipeline.sweep",
                    "pipeline.lm.task", "pipeline.lm.cell", "pipeline.lm.sweep", "pipeline.lm.config",
                    "pipeline.lm.prepare", "pipeline.lm.pretrained", "pipeline.lm.memory", "pipeline.lm.engines",
                    "pipeline.clipping", "pipeline.clipping.opacus", "hydra_plugins.pipeline_sweeper.validating_sweeper",
                    "hydra_plugins.pipeline_sweeper.searchpath"],
    "lm_finetune": ["pipeline.__main__", "pipeline.tasks", "pipeline.overrides", "pipeline.preflight", "pipeline.sweep",
                    "pipeline.lm.task", "pipeline.lm.cell", "pipeline.lm.sweep", "pipeline.lm.config",
                    "pipeline.lm.prepare", "pipeline.lm.pretrained", "pipeline.lm.memory", "pipeline.lm.engines",
                    "pipeline.clipping", "pipeline.clipping.opacus", "hydra_plugins.pipeline_sweeper.validating_sweeper",
                    "hydra_plugins.pipeline_sweeper.searchpath"],
    "lm_audit_run": ["pipeline.audit.__main__", "pipeline.audit.command", "pipeline.tasks", "pipeline.overrides", "pipeline.preflight", "pipeline.lm.task",
                     "pipeline.lm.audit", "pipeline.lm.config", "pipeline.lm.prepare", "pipeline.lm.train",
                     "pipeline.lm.models", "pipeline.lm.engines", "pipeline.audit.run", "pipeline.audit.one_run",
                     "pipeline.audit.canaries", "pipeline.clipping", "hydra_plugins.pipeline_sweeper.searchpath"],
    "dpformer_audit_run": ["pipeline.audit.__main__", "pipeline.audit.command", "pipeline.tasks", "pipeline.overrides", "pipeline.preflight",
                           "pipeline.seqrec.task", "pipeline.seqrec.audit_run", "pipeline.seqrec.audit",
                           "pipeline.seqrec.config", "pipeline.seqrec.data", "pipeline.seqrec.train",
                           "pipeline.audit.run", "pipeline.audit.one_run", "pipeline.audit.canaries",
                           "hydra_plugins.pipeline_sweeper.searchpath"],
    "lm_cost": ["benchmarks.lm_step", "pipeline.lm.engines", "pipeline.lm.models", "pipeline.lm.examples",
                "pipeline.clipping", "pipeline.clipping.opacus", "pipeline.plot"],
}


@pytest.mark.slow
@pytest.mark.parametrize("stage", sorted(LOADS))
def test_a_stage_depends_on_every_module_it_loads(stage, tmp_path):
    """The deps are listed file by file (so that one task's edits do not re-run the other's
    stages): every pipeline module the stage's process imports must be covered, and NoisyHead's
    stages must not depend on DPFormer's code nor the other way round. (The probe is forked from the
    fork server, which imports no module of this project: tests/forkserver.py.)"""
    from omegaconf import OmegaConf

    deps = OmegaConf.to_container(OmegaConf.load(ROOT / "dvc.yaml"), resolve=False)["stages"][stage]["deps"]
    code = f"import sys\nsys.path.insert(0, {str(ROOT)!r})\n" + "".join(f"import {m}\n" for m in LOADS[stage]) + (
        "print('\\n'.join(m.__file__ for n, m in list(sys.modules.items())"
        " if n.split('.')[0] in ('pipeline', 'hydra_plugins', 'benchmarks') and getattr(m, '__file__', None)))")
    (tmp_path / "loads_probe.py").write_text(code)
    proc = forkserver.run(["-m", "loads_probe"], cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    loaded = {Path(f).resolve().relative_to(ROOT).as_posix() for f in proc.stdout.split()}
    missing = [f for f in sorted(loaded) if not any(f == d or f.startswith(d.rstrip("/") + "/") for d in deps)]
    assert not missing, f"{stage} does not depend on {missing}"
    if stage.startswith(("dpformer", "lm_")):
        assert not any(f.startswith("pipeline/noisyhead") for f in loaded) and "pipeline/noisyhead" not in deps
        other = "pipeline/lm" if stage.startswith("dpformer") else "pipeline/seqrec"
        assert not any(f.startswith(other) for f in loaded) and other not in deps
    else:
        assert not any(d.startswith("pipeline/seqrec") for d in deps) and not any("seqrec" in f for f in loaded)


def _no_constant(name):
    raise ValueError(f"{name} is not JSON")


@pytest.mark.parametrize("path", sorted((ROOT / "artifacts").glob("*/metrics.json")), ids=lambda p: p.parent.name)
def test_committed_metrics_are_strict_json(path):
    """dvc metrics and every JSON reader but Python's reject NaN and Infinity (a metric a method does not
    have, such as the zero predictor's attack risk, is left out, not written as NaN)."""
    metrics = json.loads(path.read_text(), parse_constant=_no_constant)
    assert metrics and all(isinstance(v, (int, float)) for v in metrics.values())


def test_publish_leaves_out_what_json_cannot_hold(tmp_path):
    from omegaconf import OmegaConf

    from pipeline import sweep

    sweep.publish(OmegaConf.create({"report": {"dir": str(tmp_path)}}), [], {"a": 1.5, "b": float("nan"), "c": float("inf"), "n": 3})
    assert json.loads((tmp_path / "metrics.json").read_text(), parse_constant=_no_constant) == {"a": 1.5, "n": 3}


def _survives_the_lock(cmd) -> bool:
    """Whether a stage's command reads back unchanged from the text DVC's lock writer makes of it (its
    ruamel dumper folds long plain scalars, and a fold between two spaces drops one)."""
    from dvc.utils.serialize import dumps_yaml, parse_yaml

    return parse_yaml(dumps_yaml({"stages": {"s": {"cmd": cmd}}}), "dvc.lock")["stages"]["s"]["cmd"] == cmd


def test_every_stage_command_survives_the_lock_file():
    """A stage whose command does not read back from dvc.lock as dvc.yaml renders it is "changed" forever:
    `dvc repro` reruns it every time (lm_audit_run did, where an empty ${lm_audit_extra} left two spaces
    at a fold). Every stage's command, rendered from dvc.yaml and params.yaml, survives the lock writer;
    and the check does catch the fold that broke it."""
    from dvc.repo import Repo

    with Repo(str(ROOT)) as repo:
        commands = {stage.name: stage.cmd for stage in repo.index.stages if getattr(stage, "cmd", None)}
    assert len(commands) == len(yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"])
    assert [name for name, cmd in commands.items() if not _survives_the_lock(cmd)] == []
    broken = commands["lm_audit_run"][1].replace("] || exit 1; for t", "]  || exit 1; for t")
    assert broken != commands["lm_audit_run"][1] and not _survives_the_lock([broken])


def _imported(path: Path) -> set[str]:
    """The project modules ``path`` imports anywhere in its body (a function's lazy import too), as files."""
    import ast

    found = set()
    package = path.relative_to(ROOT).with_suffix("").parts[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1]) if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            names = [module] + [f"{module}.{a.name}" for a in node.names]
        for name in names:
            if name.split(".")[0] not in ("pipeline", "hydra_plugins"):
                continue
            for candidate in (ROOT / Path(*name.split("."))).with_suffix(".py"), ROOT / Path(*name.split(".")) / "__init__.py":
                if candidate.exists():
                    found.add(candidate.relative_to(ROOT).as_posix())
    return found


NARROWED = ("pipeline/clipping/", "pipeline/dpsgd/")  # packages whose files are deps one by one


def test_a_stage_depends_on_every_module_its_engine_and_trainer_files_import_even_lazily():
    """The shared engine's and trainer's files are deps one by one (a module added to their packages that no
    stage uses, such as a new engine option, leaves the stages as built): every project module one of those
    files imports, at its top or inside a function, must be a dependency too (the slow test above sees what
    a process loads at its start; this one also what a lazy import loads later), and every code file the
    stage lists must exist."""
    from omegaconf import OmegaConf

    stages = OmegaConf.to_container(OmegaConf.load(ROOT / "dvc.yaml"), resolve=False)["stages"]
    missing = {}
    for stage, spec in stages.items():
        deps = [d for d in spec.get("deps", []) if "$" not in d]
        code = [d for d in deps if d.startswith(("pipeline/", "conf/", "hydra_plugins", "benchmarks/"))]
        assert all((ROOT / d).exists() for d in code), (stage, [d for d in code if not (ROOT / d).exists()])
        assert not any(d.rstrip("/") + "/" in NARROWED for d in deps), f"{stage}: list {NARROWED}' files one by one"

        def covered(f):
            return any(f == d or f.startswith(d.rstrip("/") + "/") for d in deps)

        def files(d):  # a listed file, or a listed folder's Python files
            path = ROOT / d
            return [path] if path.is_file() and path.suffix == ".py" else sorted(path.rglob("*.py")) if path.is_dir() else []

        # what the engine's and trainer's files import, and what any listed code imports from those packages
        gaps = sorted({m for d in deps if d.startswith(("pipeline/", "hydra_plugins")) for f in files(d)
                       for m in _imported(f) if not covered(m) and (d.startswith(NARROWED) or m.startswith(NARROWED))})
        if gaps:
            missing[stage] = gaps
    assert not missing, missing
