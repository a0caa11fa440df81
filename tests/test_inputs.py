"""Bad input, through the CLI: one `error: <key> ...` line naming the value, exit 2, before
anything is computed or logged (no MLflow run, no results).

Every case is its own `python -m pipeline` process (forked from a server that has the heavy
packages imported: tests/forkserver.py); they start together (a module fixture), as many at a time as there are cores.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import forkserver
from conftest import merged
import numpy as np
import pytest

from pipeline.noisyhead import newsgroups

ROOT = Path(__file__).resolve().parents[1]
NEWSGROUPS = ("dataset=newsgroups", "regime=newsgroups", "privacy.eps=0.5")

# one worker runs every case: the module fixture starts all the processes once (under pytest-xdist's
# --dist loadgroup, cases spread over two workers each started all of them: the file's cost twice)
pytestmark = pytest.mark.xdist_group("inputs")

DPF = ("experiment=dpformer_ci", "dataset.n_users=60", "dataset.L=8", "seqrec.epochs=1")
FILE = ("experiment=dpformer_ci", "dataset=movielens", "dataset.L=5", "seqrec.epochs=1", "seqrec.batch_size=8")
SEQREC_FILES = {  # file name (made by _seqrec_files): the key its error line names
    "empty": "dataset.path", "blank_lines": "dataset.path", "non_integer": "dataset.path", "float_id": "dataset.path",
    "negative_id": "dataset.path", "zero_id": "dataset.path", "three_columns": "dataset.path",
    "binary": "dataset.path", "nul_bytes": "dataset.path", "k_core_empties": "dataset.k_core",
}

# name: (overrides, the key the error line starts with, the value it must name)
CASES = {
    "attack_mu_overflows": (("attack=perturb", "attack.mu=1e308"), "attack.mu", "1e+308"),
    "tau_nan": (("regime.tau=nan",), "regime.tau", "nan"),
    "attack_p_overflows": (("attack=perturb", "attack.p=200"), "attack.p", "200"),
    "eps_inf_tight": (("privacy.eps=inf", "privacy.accountant=tight"), "privacy.eps", "inf"),
    "eps_inf_dp_ridge": (("privacy.eps=inf", "method=[ridge,dp_ridge]"), "privacy.eps", "inf"),
    "eps_inf_ssp": (("privacy.eps=inf", "method=[ridge,ssp]"), "privacy.eps", "inf"),
    "ci_level": (("evaluate.ci_level=1.5",), "evaluate.ci_level", "1.5"),
    "plot_y": (("plot.y=foo",), "plot.y", "foo"),
    "init_scale_nan": (("regime.init_scale=nan",), "regime.init_scale", "nan"),
    "threads_negative": (("compute.threads=-1",), "compute.threads", "-1"),
    "no_method": (("method=[]",), "method", "[]"),
    "features_truncated": ((*NEWSGROUPS, "dataset.features={tmp}/truncated.npz"), "dataset.features", "truncated.npz"),
    "features_nan": ((*NEWSGROUPS, "dataset.features={tmp}/nan.npz"), "dataset.features", "NaN"),
    "output_read_only": (("hydra.run.dir={ro}/run",), "hydra.run.dir", "{ro}/run"),
    "sweep_output_read_only": (("hydra.sweep.dir={ro}/sweep", "regime.N=100,200", "-m"), "hydra.sweep.dir",
                               "{ro}/sweep"),
    "store_read_only": (("mlflow.tracking_uri=sqlite:///{ro}/mlflow.db",), "mlflow.tracking_uri", "{ro}/mlflow.db"),
    "server_unreachable": (("ENV:MLFLOW_TRACKING_URI=http://127.0.0.1:9",), "mlflow.tracking_uri", "127.0.0.1:9"),
    "N_too_large": (("regime.N=1000000000",), "regime.N", "1000000000"),
    "C_inf": (("regime.C=inf",), "regime.C", "inf"),
    "memory": (("trials=100000000",), "trials", "100000000"),
    "memory_in_a_sweep": (("regime.N=1000", "trials=2,100000000", "-m"), "in the sweep cell", "trials = 100000000"),
    "report_dir_read_only": (("report.dir={ro}/report",), "report.dir", "{ro}/report"),
    "n_test_huge": (("dataset.n_test=100000000",), "dataset.n_test", "100000000"),
    "key_typo": (("privacy.epss=0.2",), "privacy.epss", "0.2"),
    "added_key_typo": (("+privacy.epsilon=0.01",), "+privacy.epsilon", "0.01"),  # ran at eps = 0.2 before
    # numbers that pass a type check but overflow or underflow what is derived from them
    "tau_overflows_C": (("regime.tau=1e200",), "regime.tau", "1e+200"),
    "G_overflows_the_step_rule": (("regime.G=1e100",), "regime.G", "1e+100"),
    "T_rule_overflows": (("regime.T_log_power=1e308",), "regime.T_log_power", "1e+308"),
    "init_scale_overflows": (("regime.init_scale=1e308",), "regime.init_scale", "1e+308"),
    "delta_underflows_per_step": (("privacy.delta=5e-324",), "method.noisyhead", "privacy.delta = 5e-324"),
    "eps_underflows_per_step": (("privacy.eps=5e-324",), "method.noisyhead", "privacy.eps = 5e-324"),
    "eps_tiny_tight": (("privacy.eps=1e-300", "privacy.accountant=tight"), "method.noisyhead", "privacy.eps = 1e-300"),
    "threads_huge": (("compute.threads=100000000",), "compute.threads", "100000000"),
    # method and report settings read only after the compute
    "noise_scale_nan": (("method.noisyhead.noise_scale=nan",), "method.noisyhead.noise_scale", "nan"),
    "dpsgd_batch_size_text": (("method=[ridge,dpsgd]", "method.dpsgd.batch_size=abc"), "method.dpsgd", "'abc'"),
    "ssp_failure_text": (("method=[ridge,ssp]", "method.ssp.failure=abc"), "method.ssp", "'abc'"),
    "plot_colors_not_a_map": (("plot.colors=red",), "plot.colors", "red"),
    "plot_colour_unknown": (("plot.colors={{noisyhead:notacolor}}",), "plot.colors.noisyhead", "notacolor"),
    "report_table_row_in_a_sweep": (("regime.N=100,200", "report.table={{rows:[nosuch],value:excess_risk}}", "-m"),
                                    "in the sweep cell", "report.table.rows names 'nosuch'"),
    "key_typo_in_a_sweep": (("regime.N=100,200", "regime.NN=3", "-m"), "regime.NN", "3"),
    # DPFormer (task=seqrec): settings
    "key_typo_seqrec": ((*DPF, "seqrec.lrr=0.1"), "seqrec.lrr", "0.1"),
    "seqrec_eps_too_small": ((*DPF, "privacy.eps=1e-9"), "privacy.eps", "1e-09"),
    "seqrec_noisyhead_accountant": ((*DPF, "privacy.accountant=tight"), "privacy.accountant", "tight"),
    "seqrec_C_inf": ((*DPF, "clipping.C=inf"), "clipping.C", "inf"),
    "seqrec_lr_inf": ((*DPF, "seqrec.lr=inf"), "seqrec.lr", "inf"),
    "seqrec_weight_decay_inf": ((*DPF, "seqrec.weight_decay=inf"), "seqrec.weight_decay", "inf"),
    "seqrec_L_huge": (merged(*DPF, "dataset.L=100000"), "dataset.L", "100000"),
    # checks that used to fail (a traceback and a folder) instead of refusing
    "seqrec_n_users_zero": (merged(*DPF, "dataset.n_users=0"), "dataset.n_users", "0"),
    "seqrec_n_users_text": (merged(*DPF, "dataset.n_users=abc"), "dataset.n_users", "'abc'"),
    "seqrec_eps_removed": ((*DPF, "~privacy.eps"), "privacy.eps", "~privacy.eps"),
    "seqrec_bare_task": (("task=seqrec",), "model", "task=seqrec"),
    "group_null": (("regime=null",), "regime=null", "~regime"),
    "store_scheme_unknown": (("mlflow.tracking_uri=bogus://x",), "mlflow.tracking_uri", "bogus://x"),
    "store_without_host": (("mlflow.tracking_uri=http://",), "mlflow.tracking_uri", "'http://'"),
    "store_databricks_without_credentials": (("mlflow.tracking_uri=databricks", "ENV:DATABRICKS_CONFIG_FILE=/nonexistent"),
                                             "mlflow.tracking_uri", "'databricks'"),
    "connect_timeout_text": (("mlflow.connect_timeout=abc",), "mlflow.connect_timeout", "'abc'"),
    # MLflow's environment and stores that fail after the checks (issue 40)
    "mlflow_run_id_set": (("ENV:MLFLOW_RUN_ID=0f1e2d3c4b5a",), "MLFLOW_RUN_ID", "0f1e2d3c4b5a"),
    "seqrec_mlflow_run_id_set": ((*DPF, "ENV:MLFLOW_RUN_ID=0f1e2d3c4b5a"), "MLFLOW_RUN_ID", "0f1e2d3c4b5a"),
    "store_folder": (("mlflow.tracking_uri={tmp}/store_folder",), "mlflow.tracking_uri", "store_folder"),
    "store_file_uri": (("mlflow.tracking_uri=file://{tmp}/store_file",), "mlflow.tracking_uri", "file://"),
    "store_in_memory": (("mlflow.tracking_uri=sqlite:///:memory:",), "mlflow.tracking_uri", ":memory:"),
    "group_of_seqrec_in_noisyhead": (("+model=dpformer",), "+model=dpformer", "task=seqrec"),
    "seqrec_group_of_noisyhead": ((*DPF, "regime=highdim"), "regime=highdim", "task=noisyhead"),
    "sweep_too_large": (("seed=range(0,10000000000)", "-m"), "hydra.sweeper.max_cells", "70,000,000,000 cells"),
    "sweep_max_cells_zero": (("hydra.sweeper.max_cells=0", "seed=0,1", "-m"), "hydra.sweeper.max_cells", "got 0"),
    "experiment_name_too_long": (("mlflow.experiment=" + "x" * 501,), "mlflow.experiment", "501 characters"),
    "seed_above_64_bits": (("seed=18446744073709551616",), "seed", "18446744073709551616"),
    "run_dir_empty": (("hydra.run.dir=''",), "hydra.run.dir", "empty"),
    "sweep_n_jobs_zero": (("hydra/launcher=joblib", "hydra.launcher.n_jobs=0", "regime.N=100,200", "-m"),
                          "in the sweep cell", "hydra.launcher.n_jobs must be a non-zero integer"),
    "sweep_max_batch_size_zero": (("hydra.sweeper.max_batch_size=0", "regime.N=100,200", "-m"),
                                  "hydra.sweeper.max_batch_size", "got 0"),
    "dpsgd_eps_huge": (("method=[ridge,dpsgd]", "privacy.eps=1e308"), "privacy.eps", "1e+308"),
    # DPFormer: keys checked only after Hydra made the folder, or never
    "seqrec_zipf_nan": ((*DPF, "dataset.zipf=nan"), "dataset.zipf", "nan"),
    "seqrec_zipf_nan_in_a_sweep": ((*DPF, "dataset.zipf=1,nan", "-m"), "in the sweep cell", "dataset.zipf must"),
    "seqrec_sum_by": ((*DPF, "clipping.sum_by=xyz"), "clipping.sum_by", "xyz"),
    "seqrec_threads_huge": ((*DPF, "seqrec.threads=100000000"), "seqrec.threads", "100000000"),
    "seqrec_compute_threads": ((*DPF, "compute.threads=2"), "compute.threads", "2"),
    "seqrec_seed_above_64_bits": ((*DPF, "seed=18446744073709551616"), "seed", "18446744073709551616"),
    "seqrec_tied_text": ((*DPF, "model.tied=abc"), "model.tied", "abc"),
    "seqrec_k_above_items": ((*DPF, "seqrec.k=100000"), "seqrec.k", "100000"),
    "seqrec_eps_huge": ((*DPF, "privacy.eps=1e308"), "privacy.eps", "1e+308"),
    "seqrec_delta_underflows": ((*DPF, "privacy.delta=5e-324"), "privacy.eps", "privacy.delta = 5e-324"),
    "seqrec_memory_of_the_model": ((*DPF, "model.d=100000", "model.heads=1"), "model.d", "100000"),
    # issue 63: what exited 1 with Hydra's text, ran what nobody asked for, or named the wrong key
    "key_given_twice": (("privacy.eps=0.5", "privacy.eps=0.2"), "privacy.eps is given twice", "privacy.eps=0.2"),
    "group_given_twice_in_a_sweep": (("experiment=dpformer_ci", "model=dpformer", "model=transformer", "-m"),
                                     "model is given twice", "model=transformer"),
    "sweep_without_m": (("privacy.eps=0.2,0.5",), "privacy.eps=0.2,0.5", "add -m"),
    "override_syntax": (("privacy.eps=[0.2",), "privacy.eps=[0.2", "cannot read this override"),
    "lm_public_vocabulary_unreachable": (("experiment=lm_ci", "vocab=public", "vocab.size=50000"), "vocab.size",
                                         "50000"),
    "lm_memory_of_the_model": (("experiment=lm_ci", "model.d=100000", "model.heads=1"), "model.d", "100000"),
    # DPFormer: data files (SASRec's "user item" lines)
    **{f"seqrec_file_{name}": ((*FILE, f"dataset.path={{tmp}}/{name}.txt"), key, f"{name}.txt")
       for name, key in SEQREC_FILES.items()},
    "seqrec_file_all_users_too_short": ((*FILE, "dataset.path={tmp}/short.txt", "dataset.k_core=null"),
                                        "dataset.path", "short.txt"),
}


def _feature_files(folder: Path) -> None:
    """A valid feature file's truncated copy, and one with a NaN score."""
    rng = np.random.default_rng(0)
    splits = {}
    for split, n in (("train", 200), ("test", 100)):
        x = np.sort(rng.random((n, 30)), 1)[:, ::-1]
        splits[split] = (x / np.linalg.norm(x, axis=1, keepdims=True), 0.3 * rng.normal(size=n), np.arange(n) % 2)
    articles = newsgroups.Articles(*({s: splits[s][i] for s in splits} for i in range(3)))
    meta = {"D": 30, "y_center": 2.0, "vectorizer_fit": "test"}
    newsgroups.save(articles, folder / "good.npz", meta)
    data = (folder / "good.npz").read_bytes()
    (folder / "truncated.npz").write_bytes(data[: len(data) // 2])
    articles.x["train"][3, 0] = np.nan
    newsgroups.save(articles, folder / "nan.npz", meta)


def _seqrec_files(folder: Path) -> None:
    """Bad interaction files, each next to good lines; short.txt: valid lines, every user too short."""
    good = "".join(f"{u} {i}\n" for u in range(1, 8) for i in range(1, 8))
    texts = {"empty": "", "blank_lines": "\n\n  \n", "non_integer": good + "3 x\n", "float_id": good + "3 1.5\n",
             "negative_id": good + "3 -2\n", "zero_id": good + "0 2\n", "three_columns": good + "3 2 1\n",
             "nul_bytes": good + "3 \x002\n", "k_core_empties": "1 1\n1 2\n2 1\n2 3\n",
             "short": "1 1\n1 2\n2 1\n2 3\n3 4\n"}
    for name, text in texts.items():
        (folder / f"{name}.txt").write_text(text)
    (folder / "binary.txt").write_bytes(bytes(range(256)) * 4)


def _read_only(folder: Path) -> bool:
    """Make ``folder`` unwritable, for root too (immutable); False if this system cannot."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
        return True
    return shutil.which("chattr") is not None and subprocess.run(["chattr", "+i", str(folder)]).returncode == 0


def _writable_again(folder: Path) -> None:
    if os.geteuid() != 0:
        folder.chmod(0o755)
    else:
        subprocess.run(["chattr", "-i", str(folder)], capture_output=True)


def _run(name: str, base: Path, ro: Path) -> tuple[subprocess.CompletedProcess, Path]:
    overrides, _, _ = CASES[name]
    tmp = base / name
    tmp.mkdir()
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env.pop("MLFLOW_TRACKING_URI", None)
    args = []
    for arg in overrides:
        arg = arg.format(tmp=base, ro=ro)
        if arg.startswith("ENV:"):
            key, value = arg[4:].split("=", 1)
            env[key] = value
        else:
            args.append(arg)
    if "MLFLOW_TRACKING_URI" not in env and not any(a.startswith("mlflow.tracking_uri") for a in args):
        args.append(f"mlflow.tracking_uri=sqlite:///{tmp / 'mlflow.db'}")
    for key, folder in (("hydra.run.dir", "run"), ("hydra.sweep.dir", "sweep")):
        if not any(a.startswith(key) for a in args):
            args.append(f"{key}={tmp / folder}")
    flags = [a for a in args if a.startswith("-")]
    args = [a for a in args if not a.startswith("-")]
    trials = [] if any(a.startswith("trials=") for a in args) else ["trials=2"]
    proc = forkserver.run(["-m", "pipeline", *trials, *args, *flags], cwd=tmp, env=env, timeout=300)
    return proc, tmp


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    base = tmp_path_factory.mktemp("inputs")
    _feature_files(base)
    _seqrec_files(base)
    ro = base / "read-only"
    ro.mkdir()
    can = _read_only(ro)
    names = [n for n in CASES if can or "{ro}" not in " ".join(CASES[n][0])]
    try:
        with ThreadPoolExecutor(max(2, os.cpu_count() or 2)) as pool:
            done = dict(zip(names, pool.map(lambda n: _run(n, base, ro), names)))
    finally:
        _writable_again(ro)
    return done, ro


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_gives_one_error_line_and_exit_2_before_anything_runs(outcomes, name):
    done, ro = outcomes
    if name not in done:
        pytest.skip("this system cannot make a folder read-only for this user")
    proc, tmp = done[name]
    _, key, value = CASES[name]
    value = value.format(ro=ro)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert errors[0].startswith(f"error: {key}"), errors[0]
    assert value in errors[0], errors[0]
    assert "Traceback" not in proc.stderr
    # nothing computed or logged: no results anywhere, no MLflow run in the store
    assert not list(tmp.rglob("results.csv")) and not list(tmp.rglob("*.png"))
    store = tmp / "mlflow.db"
    if store.exists():
        with sqlite3.connect(store) as db:
            tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            assert "runs" not in tables or db.execute("SELECT COUNT(*) FROM runs").fetchone()[0] == 0
    assert not (tmp / "mlruns").exists()
    assert not (tmp / "run").exists() and not (tmp / "sweep").exists(), "a folder was left behind"
