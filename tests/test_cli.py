"""End to end: `python -m pipeline` as a user runs it, into a temporary MLflow store."""

import sys

import mlflow
import pandas as pd
import pytest
from conftest import ROOT, communicate_or_kill, merged

from pipeline.noisyhead.evaluate import COLUMNS

TINY = ["trials=4", "regime.N=60", "dataset.n_test=20", "compute.chunk_trials=3"]


def runs(store):
    client = mlflow.MlflowClient(tracking_uri=store)
    exps = client.search_experiments()
    return client, client.search_runs([e.experiment_id for e in exps]) if exps else []


@pytest.mark.slow
def test_single_run_logs_every_step(run_cli):
    proc = run_cli(*TINY)
    results = pd.read_csv(run_cli.tmp / "run" / "results.csv")
    assert list(results.columns) == COLUMNS
    assert sorted(results["method"]) == ["gd", "noisyhead", "ridge", "zero"]  # zero: the reference row
    assert (results["B"] == 4).all() and (results["N"] == 60).all()
    assert (run_cli.tmp / "run" / "excess_risk.png").stat().st_size > 1000
    assert "noisyhead" in proc.stderr + proc.stdout  # the printed summary

    client, found = runs(run_cli.store)
    assert len(found) == 1
    run = found[0]
    assert run.info.status == "FINISHED"
    params, metrics = run.data.params, run.data.metrics
    for key in ("train.C", "train.G", "train.R", "train.eta0", "train.T", "train.sigma", "train.lam",
                "train.noisyhead.noise_std", "train.noisyhead.step_eps", "data.fingerprint", "data.seed"):
        assert key in params, key
    T = int(params["train.T"])
    for key in ("evaluate.noisyhead.excess_risk_mean", "evaluate.noisyhead.excess_risk_sd",
                "evaluate.noisyhead.excess_risk_ci_low", "evaluate.gd.test_mse_mean", "data.clip_fraction"):
        assert key in metrics, key
    nh = results.set_index("method").loc["noisyhead"]
    assert metrics["evaluate.noisyhead.excess_risk_mean"] == pytest.approx(nh["excess_risk_mean"])
    loss = client.get_metric_history(run.info.run_id, "train.noisyhead.loss")
    assert [m.step for m in loss] == list(range(T))
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"results.csv", "excess_risk.png", "config.yaml"} <= artifacts


@pytest.mark.slow
@pytest.mark.parametrize("override,needle", [
    ("privacy.eps=-1", "privacy.eps"),
    ("privacy.delta=2", "privacy.delta"),
    ("regime.N=0", "regime.N"),
    ("trials=0", "trials"),
    ("regime.eta0=1", "eta0"),
])
def test_bad_input_fails_before_any_run(run_cli, override, needle):
    proc = run_cli(*TINY, override, expect_ok=False)
    assert proc.returncode != 0
    assert needle in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (run_cli.tmp / "run" / "results.csv").exists()
    _, found = runs(run_cli.store)
    assert found == []


@pytest.mark.slow
@pytest.mark.parametrize("choice", ["regime=nosuch", "method=[ridge,nosuch]", "model=nosuch", "clipping=nosuch",
                                    "regime=lowdim,nosuch"])
def test_unknown_option_is_one_error_line(run_cli, choice):
    """An option no conf/ group file provides: one error line naming it, exit 2, no run, no folder (in a
    sweep's list too: a list of values is a sweep, given with -m)."""
    proc = run_cli(*TINY, choice, *(["-m"] if "," in choice and "[" not in choice else []), expect_ok=False)
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr
    assert errors[0].startswith("error: ") and "'nosuch' is not an option of conf/" in errors[0]
    assert not (run_cli.tmp / "run").exists()
    _, found = runs(run_cli.store)
    assert found == []


def test_overrides_check_leaves_valid_and_non_group_values_alone():
    from pipeline.overrides import unknown_choice

    assert unknown_choice(["model=gru,lstm", "method=[ridge,noisyhead]", "regime.N=5", "seed=3", "~attack",
                           "method=[]", "hydra/launcher=joblib", "experiment=dpformer_ci"]) is None
    assert "clipping='ghosts'" in unknown_choice(["clipping=ghosts"])
    # Hydra refuses every group=null ("Config group override must be a string or a list", a traceback)
    assert unknown_choice(["attack=null"]).startswith("attack=null: a config group takes one of its options")


@pytest.mark.slow
def test_sweep_groups_its_cells_and_draws_the_figure(run_cli):
    run_cli(*merged(*TINY, "regime.N=40,60"), "privacy.eps=0.5", "-m")
    sweep = run_cli.tmp / "sweep"
    results = pd.read_csv(sweep / "results.csv")
    assert len(results) == 2 * 4 and sorted(results["N"].unique()) == [40, 60]
    assert (sweep / "excess_risk.png").stat().st_size > 1000
    _, found = runs(run_cli.store)
    parents = [r for r in found if r.data.tags.get("kind") == "sweep"]
    cells = [r for r in found if r.data.tags.get("kind") == "cell"]
    assert len(parents) == 1 and len(cells) == 2
    assert all(r.info.status == "FINISHED" for r in found)
    assert all(c.data.tags["mlflow.parentRunId"] == parents[0].info.run_id for c in cells)


@pytest.mark.slow
def test_a_bad_cell_stops_the_sweep_before_any_cell_runs(run_cli):
    proc = run_cli(*TINY, "privacy.eps=0.5,-1", "-m", expect_ok=False)
    assert proc.returncode != 0 and "privacy.eps" in proc.stderr
    assert not list((run_cli.tmp / "sweep").glob("*/results.csv"))
    _, found = runs(run_cli.store)
    assert found == []


@pytest.mark.slow
def test_table_sweep_writes_csv_and_markdown(run_cli):
    run_cli("experiment=table1_dpridge", "trials=3", "dataset.n_test=10", "regime.N=40,60", "privacy.eps=0.2", "-m")
    sweep = run_cli.tmp / "sweep"
    markdown = (sweep / "table.md").read_text().splitlines()
    assert markdown[0].startswith("| N | eps |") and "appendix B as printed" in markdown[0]
    assert len(markdown) == 2 + 2  # header, rule, one row per N
    table = pd.read_csv(sweep / "table.csv")
    assert {"dp_ridge_mean", "dp_ridge_sd", "dp_ridge_paper_mean", "noisyhead_mean"} <= set(table.columns)
    _, found = runs(run_cli.store)
    parent = next(r for r in found if r.data.tags.get("kind") == "sweep")
    client = mlflow.MlflowClient(tracking_uri=run_cli.store)
    assert {"table.md", "table.csv"} <= {a.path for a in client.list_artifacts(parent.info.run_id)}


@pytest.mark.slow
def test_a_terminated_run_is_marked_killed(run_cli):
    """SIGTERM in the middle of a cell ends its MLflow run as KILLED, not RUNNING."""
    import os
    import signal

    cmd = [sys.executable, "-m", "pipeline", f"mlflow.tracking_uri={run_cli.store}",
           f"hydra.run.dir={run_cli.tmp / 'run'}", *LONG["noisyhead"]]
    # The helper creates the store first: this test used to poll a store the cell was still creating, and the
    # two creations at once broke the cell before it started (CI, 2026-11-27: it had exited before the kill).
    proc = _start_and_wait_inside_run(cmd, run_cli.store)
    os.kill(proc.pid, signal.SIGTERM)
    out, err = communicate_or_kill(proc, 60)
    assert proc.returncode == 143, err[-3000:]  # terminated, not interrupted (130)
    _, found = runs(run_cli.store)
    assert len(found) == 1 and found[0].info.status == "KILLED"


def _start_and_wait_inside_run(cmd, store, timeout=120):
    """Start ``cmd`` (its own process group) and return it once its MLflow run is RUNNING."""
    import subprocess
    import time

    from conftest import ROOT

    runs(store)  # create the store's tables here, first: two processes creating them at once break it
    def default_sigint():  # a process started in the background (nohup, `&`) inherits SIGINT ignored
        import signal

        signal.signal(signal.SIGINT, signal.SIG_DFL)

    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=default_sigint)
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        time.sleep(0.3)
        try:
            found = runs(store)[1]
        except Exception:  # the store is still being created
            continue
        if found and found[0].info.status == "RUNNING" and found[0].data.params:
            return proc
    import os
    import signal

    if proc.poll() is None:  # never leave a run without end behind
        os.killpg(proc.pid, signal.SIGKILL)
    out, err = proc.communicate()
    raise AssertionError(f"no RUNNING run within {timeout} s (exit {proc.returncode}): {err[-2000:]}")


LONG = {"noisyhead": ["regime=overparam", "trials=400"],
        "seqrec": ["experiment=dpformer_ci", "seqrec.epochs=100000", "dataset.n_users=60", "dataset.L=8"]}


@pytest.mark.slow
@pytest.mark.parametrize("task", ["noisyhead", "seqrec"])
def test_ctrl_c_ends_a_single_run_killed_with_130_and_one_line(run_cli, task):
    import os
    import signal

    cmd = [sys.executable, "-m", "pipeline", *LONG[task], f"mlflow.tracking_uri={run_cli.store}",
           f"hydra.run.dir={run_cli.tmp / 'run'}"]
    proc = _start_and_wait_inside_run(cmd, run_cli.store)
    os.kill(proc.pid, signal.SIGINT)
    out, err = communicate_or_kill(proc, 120)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert [ln for ln in err.splitlines() if ln.startswith("error:")] == \
        ["error: interrupted (Ctrl-C); the run ended KILLED"], err[-3000:]
    _, found = runs(run_cli.store)
    assert [r.info.status for r in found] == ["KILLED"]


@pytest.mark.slow
def test_ctrl_c_before_any_run_is_one_line_and_130(tmp_path):
    """Ctrl-C while the checks run, before any run or folder exists (here a SLURM sweep whose cluster
    check, sinfo, hangs): exit 130 with one line and no traceback; nothing is left behind."""
    import os
    import signal
    import subprocess
    import time

    from conftest import ROOT

    asked = tmp_path / "asked"
    (tmp_path / "bin").mkdir()
    sinfo = tmp_path / "bin" / "sinfo"
    sinfo.write_text(f"#!/bin/sh\ntouch {asked}\nexec sleep 60\n")  # exec: killed with it, not left behind
    sinfo.chmod(0o755)
    env = dict(os.environ, PATH=f"{tmp_path / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")
    proc = subprocess.Popen([sys.executable, "-m", "pipeline", "hydra/launcher=submitit_slurm",
                             f"hydra.sweep.dir={tmp_path / 'sweep'}", f"mlflow.tracking_uri=sqlite:///{tmp_path / 'm.db'}",
                             "seed=0,1", "-m"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 120
    while not asked.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    assert asked.exists(), communicate_or_kill(proc, 10)[1][-2000:]
    os.kill(proc.pid, signal.SIGINT)
    out, err = communicate_or_kill(proc, 60)
    assert proc.returncode == 130 and "Traceback" not in err, err[-3000:]
    assert [ln for ln in err.splitlines() if ln.strip()] == ["error: interrupted (Ctrl-C); no run was left RUNNING"]
    assert not (tmp_path / "sweep").exists() and not (tmp_path / "m.db").exists()


@pytest.mark.slow
@pytest.mark.parametrize("task", ["noisyhead", "seqrec"])
def test_a_run_killed_outright_is_ended_failed_by_the_next_launch(run_cli, task):
    """SIGKILL leaves the run RUNNING (nothing in the process can end it); the next launch on this
    host finds its owner gone and ends it FAILED, with the reason as a tag."""
    import os
    import signal

    cmd = [sys.executable, "-m", "pipeline", *LONG[task], f"mlflow.tracking_uri={run_cli.store}",
           f"hydra.run.dir={run_cli.tmp / 'killed'}"]
    proc = _start_and_wait_inside_run(cmd, run_cli.store)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    _, found = runs(run_cli.store)
    assert [r.info.status for r in found] == ["RUNNING"]
    run_cli(*TINY)  # any launch into the store (here a NoisyHead run)
    _, found = runs(run_cli.store)
    statuses = {r.info.run_id: r.info.status for r in found}
    dead = [r for r in found if r.data.tags.get("failed_reason")]
    assert len(dead) == 1 and statuses[dead[0].info.run_id] == "FAILED", statuses
    assert f"pid {proc.pid}" in dead[0].data.tags["failed_reason"]
    assert sorted(statuses.values()) == ["FAILED", "FINISHED"]


@pytest.mark.slow
def test_a_deleted_experiment_is_refused_with_one_line(run_cli):
    client = mlflow.MlflowClient(tracking_uri=run_cli.store)
    client.delete_experiment(client.create_experiment("noisyhead-icl"))
    proc = run_cli(*TINY, expect_ok=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    [line] = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert line.startswith("error: mlflow.experiment = 'noisyhead-icl' is deleted") and "restore" in line
    assert "Traceback" not in proc.stderr and not (run_cli.tmp / "run").exists()


def test_one_trial_gives_no_interval_rather_than_a_zero_width_one():
    import math

    import torch

    from pipeline.noisyhead import evaluate

    one = evaluate.summarize(torch.tensor([0.3], dtype=torch.float64), 0.95, "excess_risk")
    assert one["excess_risk_mean"] == 0.3 and math.isnan(one["excess_risk_ci_low"]) and math.isnan(one["excess_risk_ci_high"])
    assert math.isnan(one["excess_risk_sd"])  # undefined, not 0
    from pipeline.noisyhead.cell import summary

    row = {"method": "noisyhead", "T": 5, "test_mse_mean": 1.0, "attack_risk_mean": math.nan, **one}
    line = summary(pd.DataFrame([row])).splitlines()[1]
    assert "0.3 +- n/a" in line and "[       n/a,        n/a]" in line and "nan" not in line, line
    two = evaluate.summarize(torch.tensor([0.3, 0.5], dtype=torch.float64), 0.95, "excess_risk")
    assert two["excess_risk_ci_low"] < 0.4 < two["excess_risk_ci_high"]


@pytest.mark.slow
def test_help_says_first_what_the_project_is(run_cli):
    proc = run_cli("--help")
    first = proc.stdout.splitlines()[0]
    assert first.startswith("Experiments on differentially private attention: NoisyHead"), first
    assert "DPFormer" in proc.stdout.split("\n\n")[0] and "== Configuration groups ==" in proc.stdout
    assert "experiment=lm_ci --help" in proc.stdout and "task: lm" in proc.stdout  # issue 63: the third task said


@pytest.mark.parametrize("overrides", [[], ["experiment=dpformer_ci", "model=gru", "privacy.eps=3"]])
def test_fast_help_is_hydras_help_page(overrides):
    """``python -m pipeline --help`` prints pipeline.usage's page, which must be Hydra's own app help
    (header, groups and options, composed config, footer) for the same overrides, character for
    character: here Hydra's ``app_help`` steps (its compose, sanitising and ``get_help``), in-process."""
    import copy

    from hydra import initialize_config_dir
    from hydra._internal.utils import get_args_parser
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    from pipeline import usage

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        hydra = GlobalHydra.instance().hydra
        cfg = hydra.compose_config("config", overrides, run_mode=RunMode.RUN, with_log_configuration=False)
        clean = hydra.get_sanitized_cfg(copy.deepcopy(cfg), "job")
        hydras = hydra.get_help(cfg.hydra.help, clean, get_args_parser(), resolve=False)
    assert "== Configuration groups ==" in hydras and "seqrec/model: dpformer," in hydras
    assert usage.text(overrides) == hydras
    assert usage.wanted(["--help", *overrides]) and not usage.wanted(["--help", "-m"])


def test_a_group_of_the_other_task_is_refused_naming_it():
    """model=dpformer in a NoisyHead run (Hydra's own advice, +model=dpformer, ran NoisyHead and ignored
    it) and regime=highdim in a DPFormer run (ignored) are one error line naming the group and its task."""
    from pipeline.overrides import other_tasks_group

    for args in (["model=dpformer"], ["+model=dpformer"], ["clipping=phantom", "trials=4"]):
        group, choice = args[0].lstrip("+").split("=")
        message = other_tasks_group(args)
        assert message.startswith(f"{args[0]}: {choice} is an option of the config group {group} of task=seqrec"), message
        assert "this command runs task=noisyhead, which would ignore it" in message, message
        assert "(experiment=dpformer_ci, " in message and "conf/seqrec/experiment/)" in message, message  # runnable presets, the quickest first
    message = other_tasks_group(["experiment=dpformer_ci", "regime=highdim"])
    assert message.startswith("regime=highdim: highdim is an option of the config group regime of task=noisyhead"), message
    assert message.endswith("runs task=seqrec, which would ignore it; drop it"), message
    assert other_tasks_group(["task=seqrec", "method=[ridge]"]).startswith("method=[ridge]: ridge is an option")
    # the language model chooses its engine with a key, not a group: the message says which key
    message = other_tasks_group(["experiment=lm_ci", "clipping=per_sample"])
    assert message.startswith("clipping=per_sample: per_sample is an option of the config group clipping of task=seqrec"), message
    assert message.endswith("runs task=lm, which chooses it with the key clipping.name: use clipping.name=per_sample "
                            "(conf/lm/experiment/lm_cpu.yaml)"), message
    assert "use clipping.name=phantom,per_sample (" in other_tasks_group(["experiment=lm_ci", "clipping=phantom,per_sample"])
    # a group several tasks have is judged by option: the running task's own options are named
    message = other_tasks_group(["task=seqrec", "dataset=newsgroups"])
    assert message.startswith("dataset=newsgroups: newsgroups is an option of the config group dataset of task=noisyhead"), message
    assert "whose dataset options are [" in message and "'amazon_games'" in message, message
    for fine in (["experiment=dpformer_ci", "model=gru", "clipping=ghost"], ["regime=highdim", "attack=perturb"],
                 ["experiment=fig1_lowdim,dpformer_ci", "model=gru"],  # a sweep over both tasks: Hydra's to judge
                 ["experiment=dpformer_ci", "~regime"], ["dataset=newsgroups"], ["experiment=dpformer_ci", "dataset=movielens"]):
        assert other_tasks_group(fine) is None, fine


def test_a_key_added_beside_a_close_one_is_refused_and_a_new_one_is_added():
    """+privacy.epsilon=0.01 ran at the default eps with an unread epsilon beside it: now one error
    naming the close key; a + key with no close neighbour is still Hydra's to add."""
    from pipeline.overrides import unknown_key

    message = unknown_key(["+privacy.epsilon=0.01"])
    assert message.startswith("+privacy.epsilon=0.01: privacy.epsilon is not a key"), message
    assert "did you mean privacy.eps?" in message, message
    assert unknown_key(["+privacy.note=1"]) is None
    assert unknown_key(["++privacy.eps=0.5"]) is None


def test_a_key_given_twice_is_refused_and_an_unknown_option_gets_the_closest():
    """Issue 63: a key or group given twice with two values ran the last (with a warning): a sweep
    launched so ran cells nobody asked for. Now one error naming the key; the same override twice
    changes nothing and passes."""
    from pipeline.overrides import repeated, unknown_choice

    assert repeated(["privacy.eps=0.5", "trials=3", "privacy.eps=0.2"]) == (
        "privacy.eps is given twice (privacy.eps=0.5, then privacy.eps=0.2): give it once (several values are a "
        "sweep: privacy.eps=a,b with -m)")
    assert repeated(["model=dpformer", "model=transformer"]).startswith("model is given twice (model=dpformer, then ")
    assert repeated(["model=dpformer", "+model=transformer"]).startswith("model is given twice")
    assert repeated(["trials=3", "trials=3", "-m", "regime.N=1,2"]) is None  # the same twice changes nothing
    message = unknown_choice(["regime=lowdimm"])
    assert "options: ['highdim', 'lowdim'," in message and message.endswith("did you mean regime=lowdim?"), message


@pytest.mark.parametrize("argv, start, fix", [
    (["privacy.eps=0.2,0.5"], "privacy.eps=0.2,0.5: several values of privacy.eps are a sweep", "add -m"),
    (["regime.N=range(1000,3000,1000)"], "regime.N=range(1000,3000,1000): several values of regime.N", "add -m"),
    (["privacy.eps=[0.2"], "privacy.eps=[0.2: Hydra cannot read this override", "write key=value"),
    (["trials"], "trials: Hydra cannot read this override (missing EQUAL", "write key=value"),
    (["privacy.eps=0.2,", "-m"], "privacy.eps=0.2,: Hydra cannot read this override", "key='a, b'"),
])
def test_a_sweep_without_m_and_hydras_syntax_errors_are_one_line_with_the_fix(argv, start, fix):
    """Issue 63: these exited 1 with Hydra's several lines; now one line naming the override, with
    the fix. A sweep with -m, a list and a quoted string pass; other flags stay Hydra's."""
    from pipeline.overrides import syntax

    message = syntax(argv)
    assert message.startswith(start) and fix in message, message
    assert syntax(["privacy.eps=0.2,0.5", "-m"]) is None and syntax(["'method=[ridge,gd]'".strip("'")]) is None
    assert syntax(["experiment_name='a,b'"]) is None and syntax(["--cfg", "job", "privacy.eps=[0.2"]) is None
    one = syntax(["privacy.eps=0.2,0.5", "-m"], sweeps=False)  # the audit: one config, -m or not
    assert one.startswith("privacy.eps=0.2,0.5: privacy.eps is given several values, and this command runs one config")


def test_key_check_leaves_valid_keys_sweeps_and_additions_alone():
    from pipeline.overrides import unknown_key

    assert unknown_key(["privacy.eps=0.5", "regime.N=100,200", "+extra.key=1", "hydra.run.dir=/tmp/x", "-m"]) is None
    assert unknown_key(["experiment=dpformer_ci", "model=dpformer", "model.reattention.form=off,paper", "-m"]) is None
    assert unknown_key(["regime.N=range(1,3)"]) is None  # a sweep function: its first value is checked
    assert unknown_key(["--cfg", "job", "privacy.epss=1"]) is None  # other flags: Hydra's to judge
    assert unknown_key(["-m", "method=glob(*)"]) is None  # a sweep function Hydra resolves later
    two = unknown_key(["privacy.epss=1", "privacy.deltaa=2"])  # the first is named, its section listed
    assert two.startswith("privacy.epss=1: ") and "(privacy has: accountant, delta, eps)" in two, two
    assert unknown_key(["privacy.eps.foo=1"]).endswith("(privacy.eps is a value, not a section of keys)")
    message = unknown_key(["experiment=dpformer_ci", "model=dpformer", "model.reattention.errorz=adam"])
    assert message.startswith("model.reattention.errorz=adam: model.reattention.errorz is not a key")
    assert message.endswith("did you mean model.reattention.errors?")
    top = unknown_key(["trial=4"])  # a top-level key: the config's own keys listed (it said "( is not one either)")
    assert top.startswith("trial=4: trial is not a key of the config (the config has: attack, compute,"), top
    assert top.endswith("did you mean trials?"), top


def test_a_command_started_inside_the_checkout_but_not_at_its_root_is_refused(tmp_path):
    """Issue 63: `cd docs && python -m pipeline` made docs/mlflow.db, docs/mlruns and docs/outputs, a
    second store the UI's links did not open. Inside a checkout only its root is accepted; outside any
    checkout (a folder of one's own, the tests' temporary folders) the working directory is the user's."""
    from pipeline.overrides import subfolder

    assert subfolder(ROOT) is None
    message = subfolder(ROOT / "docs")
    assert message == (f"the working directory {ROOT / 'docs'} is inside the repository {ROOT}: run from its root "
                       f"(cd {ROOT}), where the default MLflow store (mlflow.db, what `mlflow ui` started there shows), "
                       "outputs/ and the data paths are")
    assert subfolder(ROOT / "pipeline" / "lm") is not None and subfolder(tmp_path) is None
    clone = tmp_path / "clone"  # another checkout (a DVC test's copy, a worktree): its own root is fine
    (clone / "pipeline").mkdir(parents=True)
    (clone / "conf").mkdir()
    (clone / "pipeline" / "__main__.py").write_text("")
    (clone / "conf" / "config.yaml").write_text("")
    assert subfolder(clone) is None and str(clone) in subfolder(clone / "conf")


@pytest.mark.slow
@pytest.mark.parametrize("module", ["pipeline", "pipeline.audit"])
def test_from_a_subfolder_the_run_is_one_error_line_and_leaves_nothing_there(module):
    import os
    import subprocess

    before = set(os.listdir(ROOT / "docs"))
    proc = subprocess.run([sys.executable, "-m", module, "trials=2"], cwd=ROOT / "docs", capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=300)
    assert proc.returncode == 2 and proc.stderr.startswith("error: the working directory"), proc.stderr[-2000:]
    assert len(proc.stderr.splitlines()) == 1 and set(os.listdir(ROOT / "docs")) == before
