"""End to end: `python -m pipeline experiment=dpformer_ci ...` into a temporary MLflow store, every
model and every clipping engine on tiny synthetic data; bad input refused before any run."""

import re

import mlflow
import pandas as pd
import pytest
from conftest import merged

from pipeline.validation import ConfigError
from pipeline.seqrec import config as seqconfig

TINY = ["experiment=dpformer_ci", "dataset.n_users=80", "dataset.L=10", "seqrec.batch_size=40"]


def runs(store):
    client = mlflow.MlflowClient(tracking_uri=store)
    exps = client.search_experiments()
    return client, client.search_runs([e.experiment_id for e in exps]) if exps else []


def check_cells(run_cli, expected: set[tuple[str, str]], epochs: int):
    client, found = runs(run_cli.store)
    cells = [r for r in found if r.data.tags.get("kind") == "cell"]
    parents = [r for r in found if r.data.tags.get("kind") == "sweep"]
    assert all(r.info.status == "FINISHED" for r in found)
    assert {(r.data.params["train.model"], r.data.params["train.clipping"]) for r in cells} == expected
    assert len(parents) == 1 and all(c.data.tags["mlflow.parentRunId"] == parents[0].info.run_id for c in cells)
    for r in cells:
        p, m = r.data.params, r.data.metrics
        private = p["train.clipping"] != "none"
        assert float(p["train.sigma"]) > 0 if private else float(p["train.sigma"]) == 0
        if private:  # the accountant's eps for the noise used: the target, to its tolerance
            assert 7.98 <= float(p["train.eps_spent"]) <= 8.0
        assert p["data.users"] == "80" and int(p["train.steps"]) == epochs * 2
        for key in ("train.loss", "evaluate.valid_ndcg10", "evaluate.valid_hit10"):
            history = client.get_metric_history(r.info.run_id, key)
            assert [h.step for h in history] == list(range(1, epochs + 1)), key
        assert 0 <= m[f"evaluate.{p['train.model']}.test_ndcg10"] <= m[f"evaluate.{p['train.model']}.test_hit10"] <= 100
        assert "evaluate.popular.test_hit10" in m and "evaluate.oracle.test_ndcg10" in m
        assert {"results.csv", "curves.png", "config.yaml"} <= {a.path for a in client.list_artifacts(r.info.run_id)}
    sweep = run_cli.tmp / "sweep"
    results = pd.read_csv(sweep / "results.csv")
    assert set(zip(results.loc[results["method"] == results["model"], "model"],
                   results.loc[results["method"] == results["model"], "clipping"])) == expected
    assert (sweep / "test_metrics.png").stat().st_size > 1000
    assert all((d / "curves.png").stat().st_size > 1000 for d in sweep.iterdir() if d.is_dir() and (d / "results.csv").exists())


@pytest.mark.slow
def test_every_model_with_phantom(run_cli):
    models = ["transformer", "transformer_untied_half", "gru", "lstm"]  # transformer_untied: next test
    run_cli(*TINY, "seqrec.epochs=2", f"model={','.join(models)}", "clipping=phantom", "-m")
    check_cells(run_cli, {(m, "phantom") for m in models}, epochs=2)


@pytest.mark.slow
def test_every_engine(run_cli):
    run_cli(*TINY, "seqrec.epochs=1", "model=transformer_untied", "clipping=none,per_sample,ghost", "-m")
    check_cells(run_cli, {("transformer_untied", e) for e in ("none", "per_sample", "ghost")}, epochs=1)


@pytest.mark.slow
def test_bad_input_one_error_line_exit_2_no_run(run_cli):
    proc = run_cli(*TINY, "clipping=ghost", expect_ok=False)
    needle = "clipping=ghost with model=transformer"
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and needle in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert not (run_cli.tmp / "run" / "results.csv").exists()
    assert runs(run_cli.store)[1] == []


@pytest.mark.slow
@pytest.mark.parametrize("override", ["clipping.C=inf", "seqrec.lr=inf", "seqrec.weight_decay=inf", "model.init_std=inf"])
def test_infinite_settings_are_refused_before_anything(run_cli, override):
    proc = run_cli(*TINY, override, expect_ok=False)
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-2000:]
    assert errors[0].startswith(f"error: {override.split('=')[0]} must be a finite number")
    assert runs(run_cli.store)[1] == [] and not (run_cli.tmp / "run").exists()


@pytest.mark.slow
def test_training_that_diverges_ends_failed_with_no_results(run_cli):
    """seqrec.lr = 1e10 is a legal number whose training goes to NaN: it stops at the first step whose
    loss or gradient is not finite and says which; the run ends FAILED with the reason as a tag (not
    FINISHED with NaN metrics), the console gets one error: line and no traceback, exit 1, and no
    results.csv is written."""
    proc = run_cli(*TINY, "seqrec.lr=1e10", expect_ok=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 1 and len(errors) == 1, proc.stderr[-2000:]
    assert re.match(r"error: training diverged at step \d+ of \d+ \(epoch 1\): the (loss|gradient) is not finite",
                    errors[0]), errors
    assert "Traceback" not in proc.stderr and "HYDRA_FULL_ERROR" not in proc.stderr, proc.stderr[-2000:]
    found = runs(run_cli.store)[1]
    assert [r.info.status for r in found] == ["FAILED"]
    assert found[0].data.tags["failed_reason"] == errors[0][len("error: "):]
    assert not (run_cli.tmp / "run" / "results.csv").exists()


@pytest.mark.slow
def test_a_diverging_cell_fails_alone_and_the_sweep_goes_on(run_cli):
    """In a sweep, a cell whose training diverges ends FAILED and is named; the other cells run, the
    summary is written from them, and the sweep exits 1 (a SystemExit from the cell once stopped it)."""
    proc = run_cli(*TINY, "seqrec.lr=1e10,0.01", "-m", expect_ok=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "1 of 2 cells failed" in out and "training diverged at step" in out, out[-3000:]
    results = pd.read_csv(run_cli.tmp / "sweep" / "results.csv")
    assert set(results["lr"]) == {0.01}
    statuses = sorted(r.info.status for r in runs(run_cli.store)[1])
    assert statuses == ["FAILED", "FINISHED", "FINISHED"], statuses  # the two cells and the sweep's parent run


@pytest.mark.slow
def test_missing_data_file_refused(run_cli):
    proc = run_cli("experiment=dpformer_movielens", "dataset.path=/nonexistent/ratings.dat", expect_ok=False)
    assert proc.returncode == 2 and proc.stderr.count("error:") == 1 and "dataset.path" in proc.stderr
    assert runs(run_cli.store)[1] == []


@pytest.mark.slow
def test_a_bad_cell_stops_the_sweep_before_any_cell_runs(run_cli):
    proc = run_cli(*TINY, "model=transformer,transformer_untied", "clipping=ghost", "-m", expect_ok=False)
    assert proc.returncode == 2 and "clipping=ghost" in proc.stderr
    assert runs(run_cli.store)[1] == []


@pytest.mark.parametrize("override,needle", [
    ("model.arch=nosuch", "model.arch"),
    ("clipping.name=nosuch", "clipping.name"),
    ("privacy.eps=-1", "privacy.eps"),
    ("privacy.eps=0", "privacy.eps"),
    ("dataset.L=1", "dataset.L"),
    ("clipping.C=0", "clipping.C"),
    ("seqrec.accountant=basic", "seqrec.accountant"),
    ("task=nosuch", "task"),
])
def test_validation_names_the_key(cfg_for, override, needle):
    from pipeline import tasks

    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        tasks.validate(cfg_for(*TINY, override))


def test_ghost_clipping_of_a_recurrent_model_is_refused_before_it_runs(cfg_for):
    """The GRU's and LSTM's recurrent layer is called at every step: Opacus's ghost clipping refuses
    it at the first forward pass; the config refuses it before anything runs, naming the pair."""
    from pipeline import tasks

    for model in ("gru", "lstm"):
        with pytest.raises(ConfigError, match=f"clipping=ghost with model={model}: .* layer called more than once"):
            tasks.validate(cfg_for(*TINY, f"model={model}", "clipping=ghost", "model.tied=false"))
    tasks.validate(cfg_for(*TINY, "model=gru", "clipping=per_sample"))


def test_unknown_model_or_clipping_option_is_refused_by_hydra(cfg_for):
    for override in ("model=nosuch", "clipping=nosuch"):
        with pytest.raises(Exception, match="nosuch"):
            cfg_for(*TINY, override)


@pytest.mark.parametrize("preset", ["dpformer_amazon", "dpformer_movielens"])
def test_paper_scale_presets_sweep_the_papers_protocol(cfg_for, preset):
    """The paper's scale: 100 epochs, its 5 x 5 grid of learning rate and batch size, 3 seeds,
    eps in {3, 5, 8, 10}, the vanilla Transformer against DPFormer, each selected on validation."""
    cfg = cfg_for(f"experiment={preset}", hydra=True)
    grid = {k: str(v).split(",") for k, v in cfg.hydra.sweeper.params.items()}
    assert grid["seqrec.lr"] == ["0.001", "0.003", "0.005", "0.007", "0.009"]
    assert grid["seqrec.batch_size"] == ["256", "512", "1024", "2048", "4096"]
    assert grid["seed"] == ["0", "1", "2"] and grid["privacy.eps"] == ["3", "5", "8", "10"]
    assert grid["model"] == ["transformer", "dpformer_public", "dpformer"]
    assert cfg.seqrec.epochs == 100 and cfg.seqrec.warmup == 0.2 and cfg.dataset.max_items is None
    # README's SLURM line: one GPU per array task
    slurm = cfg_for(f"experiment={preset}", "compute.device=cuda", "hydra/launcher=submitit_slurm",
                    "hydra.launcher.gres=gpu:1", "hydra.launcher.array_parallelism=50", hydra=True)
    assert slurm.hydra.launcher.gres == "gpu:1" and slurm.hydra.launcher.array_parallelism == 50


@pytest.mark.slow
def test_presets_validate(cfg_for):
    for preset in ("dpformer_ci", "dpformer_synthetic", "dpformer_amazon"):
        cfg = cfg_for(f"experiment={preset}")
        assert cfg.task == "seqrec" and "regime" not in cfg
        if preset != "dpformer_amazon" or (seqconfig.data.REPO_ROOT.parent / "shared/data/amazon-games-sasrec.txt").exists():
            seqconfig.validate(cfg)


@pytest.mark.slow
def test_a_batch_larger_than_the_users_is_named_and_recorded_as_clamped(run_cli):
    """Poisson sampling cannot expect more users than there are: B becomes n_users (q = 1); the run
    says so and its results record the B that ran (not the one asked for)."""
    proc = run_cli(*merged(*TINY, "seqrec.epochs=1", "seqrec.batch_size=100000"))
    assert "seqrec.batch_size = 100000 is more than the data set's 80 users" in proc.stdout + proc.stderr
    results = pd.read_csv(run_cli.tmp / "run" / "results.csv")
    assert set(results["batch_size"]) == {80}
