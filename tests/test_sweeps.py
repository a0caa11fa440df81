"""Sweeps that never mix, lose or hide results: unique folders, a summary of exactly this sweep's
cells, failed cells named next to the summary of the others, resume, the default store under
parallel jobs, the joblib and submitit launchers, SIGTERM."""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import forkserver
import mlflow
import pandas as pd
import pytest

from conftest import ROOT, merged

TINY = ["trials=2", "regime.N=40", "dataset.n_test=10", "compute.chunk_trials=2", "method=[ridge,noisyhead]"]
ENV = dict(os.environ, PYTHONWARNINGS="ignore")

# `python -m pipeline`, with the evaluation of every N = 60 cell failing at run time
FAIL_AT_60 = """
import sys
from pipeline.noisyhead import evaluate
real = evaluate.run
def run(problem, fits, const, *rest):
    if const.N == 60:
        raise RuntimeError("injected failure")
    return real(problem, fits, const, *rest)
evaluate.run = run
import runpy
runpy.run_module("pipeline", run_name="__main__", alter_sys=True)
"""


def cli(*args, cwd=ROOT, code=None, timeout=600):
    """`python -m pipeline args`, or `code` (a module's text) run as `python -m` with args, forked
    (tests/forkserver.py)."""
    if code is None:
        return forkserver.run(["-m", "pipeline", *args], cwd=cwd, env=ENV, timeout=timeout)
    with tempfile.TemporaryDirectory(prefix="cli-") as folder:  # the module's folder: its working folder
        Path(folder, "injected.py").write_text(code)
        return forkserver.run(["-m", "injected", *args], cwd=folder, env=ENV, timeout=timeout)


def all_runs(store):
    client = mlflow.MlflowClient(tracking_uri=store)
    return client, client.search_runs([e.experiment_id for e in client.search_experiments()], max_results=1000)


def error_lines(proc):
    return [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error:")]


def test_runs_and_sweeps_started_together_get_their_own_folders(cfg_for):
    first, second = cfg_for(hydra=True).hydra, cfg_for(hydra=True).hydra
    assert first.run.dir != second.run.dir and first.sweep.dir != second.sweep.dir
    assert first.run.dir.startswith("outputs/runs/") and first.sweep.dir.startswith("outputs/multirun/")


@pytest.mark.slow
def test_failed_cell_resume_and_reuse_of_a_sweep_folder(tmp_path):
    """One sweep folder, three launches: (1) the N = 60 cell fails at run time: the summary holds
    N = 40, the failed cell is named, exit 1; (2) the same command with resume, in joblib workers:
    N = 40 is skipped, N = 60 runs, a stale RUNNING run of the folder is marked FAILED, the summary
    covers both; (3) another sweep into the same folder, through submitit: its table, summary and
    report hold only its own cell."""
    store, sweep, report = f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "sweep", tmp_path / "report"
    common = [*TINY, f"mlflow.tracking_uri={store}", f"hydra.sweep.dir={sweep}", f"report.dir={report}"]

    proc = cli(*merged(*common, "regime.N=40,60"), "-m", code=FAIL_AT_60)
    assert proc.returncode == 1, proc.stderr[-3000:]
    [line] = error_lines(proc)
    assert "1 of 2 cells failed" in line and "regime.N=60" in line
    assert list(pd.read_csv(sweep / "results.csv")["N"].unique()) == [40]
    assert json.loads((report / "metrics.json").read_text())["cells"] == 1
    client, found = all_runs(store)
    [parent] = [r for r in found if r.data.tags["kind"] == "sweep"]
    assert "regime.N=60" in parent.data.params["failed_cells"] and parent.data.params["cells"] == "1"
    assert sorted(r.info.status for r in found if r.data.tags["kind"] == "cell") == ["FAILED", "FINISHED"]
    first_40 = next(r.info.run_id for r in found if r.info.status == "FINISHED" and r.data.tags["kind"] == "cell")

    # a cell of this folder killed with SIGKILL would have left its run RUNNING
    experiment = client.get_experiment_by_name("noisyhead-icl").experiment_id
    stale = client.create_run(experiment, tags={"kind": "cell", "sweep_dir": str(sweep.resolve())}).info.run_id

    proc = cli(*merged(*common, "regime.N=40,60"), "hydra.sweeper.resume=true", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2",
               "-m")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(pd.read_csv(sweep / "results.csv")["N"].unique()) == [40, 60]
    client, found = all_runs(store)
    assert client.get_run(stale).info.status == "FAILED"
    cells = [r for r in found if r.data.tags["kind"] == "cell" and r.info.status == "FINISHED"]
    assert len(cells) == 2 and first_40 in {r.info.run_id for r in cells}  # N = 40 was not recomputed
    parent = max((r for r in found if r.data.tags["kind"] == "sweep"), key=lambda r: r.info.start_time)
    assert parent.data.params["cells"] == "2" and "failed_cells" not in parent.data.params
    assert all(r.data.tags["mlflow.parentRunId"] == parent.info.run_id for r in cells)

    proc = cli(*common, "seed=1", "regime.N=40", "report.table={rows:[N],value:excess_risk}",
               "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=10", "-m")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len((sweep / "table.md").read_text().splitlines()) == 2 + 1
    for table in (sweep / "results.csv", report / "results.csv"):
        results = pd.read_csv(table)
        assert list(results["seed"].unique()) == [1] and list(results["N"].unique()) == [40], table
    assert json.loads((report / "metrics.json").read_text())["cells"] == 1
    _, found = all_runs(store)
    parent = max((r for r in found if r.data.tags["kind"] == "sweep"), key=lambda r: r.info.start_time)
    assert parent.data.params["cells"] == "1"
    [cell] = [r for r in found if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert cell.data.params["data.seed"] == "1" and cell.data.tags["sweep"] == parent.data.tags["sweep"]
    assert not [r for r in found if r.info.status == "RUNNING"]


@pytest.mark.slow
def test_a_failing_end_of_sweep_exits_nonzero_with_one_error_line(run_cli):
    report = run_cli.tmp / "report"
    (report / "results.csv").mkdir(parents=True)  # the report's table cannot be written
    proc = run_cli(*TINY, f"report.dir={report}", "-m", expect_ok=False)
    assert proc.returncode == 1
    [line] = error_lines(proc)
    assert "results.csv" in line and "Traceback" not in proc.stderr
    _, found = all_runs(run_cli.store)  # the parent run was logged before the report failed
    assert sorted(r.data.tags["kind"] for r in found if r.info.status == "FINISHED") == ["cell", "sweep"]


@pytest.mark.slow
def test_parallel_jobs_on_a_fresh_default_store_lose_nothing(tmp_path):
    """8 processes open MLflow's default store (./mlflow.db) for the first time at once."""
    code = ("import sys; from omegaconf import OmegaConf; from pipeline import tracking\n"
            "tracking.setup(OmegaConf.create({'mlflow': {'tracking_uri': None, 'experiment': 'e'}}))\n"
            "with tracking.run('job', {'kind': 'cell'}):\n"
            "    tracking.log_metrics('cell', {'job': float(sys.argv[1])})\n")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(i)], cwd=tmp_path, env=ENV,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for i in range(8)]
    errors = [p.communicate(timeout=300)[1] for p in procs]
    assert all(p.returncode == 0 for p in procs), [e[-500:] for e in errors if e]
    _, found = all_runs(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert sorted(r.data.metrics["cell.job"] for r in found if r.info.status == "FINISHED") == list(range(8))


def _descendants(pid):
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found += [int(entry), *_descendants(int(entry))]
    return found


def _alive(pid):
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _joblib_sweep_inside_its_cells(tmp_path):
    """A 2-cell joblib sweep (its own process group), once both cells are inside their runs:
    (process, store, the sweep's descendant pids: its workers and loky's resource tracker)."""
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cmd = [sys.executable, "-m", "pipeline", f"mlflow.tracking_uri={store}", f"hydra.sweep.dir={tmp_path / 'sweep'}",
           "regime=overparam", "trials=400", "regime.N=1000,1001", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "-m"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    logs = [tmp_path / "sweep" / str(i) / "__main__.log" for i in (0, 1)]
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:  # each cell's log says it fitted inside its run
        time.sleep(0.5)  # (the store is not read meanwhile: a client here racing the sweep to create it failed the sweep)
        if all(log.is_file() and "train: ridge fitted" in log.read_text() for log in logs):
            break
    return proc, store, _descendants(proc.pid)


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc for the workers")
def test_sigterm_stops_a_joblib_sweep_its_workers_and_its_runs(tmp_path):
    proc, store, workers = _joblib_sweep_inside_its_cells(tmp_path)
    assert workers
    os.kill(proc.pid, signal.SIGTERM)
    try:
        assert proc.wait(timeout=60) == 143
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    deadline = time.time() + 20  # the workers go with it (left alone they ran on for minutes)
    while time.time() < deadline and [pid for pid in workers if _alive(pid)]:
        time.sleep(0.5)
    assert not [(pid, open(f"/proc/{pid}/cmdline").read()) for pid in workers if _alive(pid)]
    _, found = all_runs(store)
    assert [r.info.status for r in found] == ["KILLED", "KILLED"]


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc for the workers")
def test_sigkill_of_a_joblib_sweep_takes_its_workers_and_the_next_launch_ends_their_runs(tmp_path):
    """SIGKILL leaves the sweep no chance to stop anything: its loky workers once computed on for 10
    minutes and more (tracking.die_with_parent). They now exit within seconds, and the next launch
    into the store ends the runs they held FAILED (tracking.reap)."""
    proc, store, workers = _joblib_sweep_inside_its_cells(tmp_path)
    try:
        assert workers and proc.poll() is None
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.time() + 30
        while time.time() < deadline and [pid for pid in workers if _alive(pid)]:
            time.sleep(0.5)
        assert not [(pid, open(f"/proc/{pid}/cmdline").read()) for pid in workers if _alive(pid)]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in workers:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    _, found = all_runs(store)
    assert [r.info.status for r in found] == ["RUNNING", "RUNNING"]  # the two cells' runs, their owners gone
    subprocess.run([sys.executable, "-m", "pipeline", f"mlflow.tracking_uri={store}", f"hydra.run.dir={tmp_path / 'one'}",
                    "regime.N=40", "trials=2"], cwd=ROOT, env=ENV, capture_output=True, timeout=300, check=True)
    statuses = sorted(r.info.status for r in all_runs(store)[1])
    assert statuses == ["FAILED", "FAILED", "FINISHED"], statuses


@pytest.mark.slow
@pytest.mark.parametrize("sweep_id", ["6e123456", "00001234"])
def test_a_sweep_id_that_looks_like_a_number_still_matches_its_cells(run_cli, sweep_id):
    """A random hex id such as 6e123456 (about 3% of them) once reached the cells as the float inf,
    so the sweep found none of its cells and reported every one failed."""
    proc = run_cli(*merged(*TINY, "regime.N=40,60"), f"hydra.sweeper.sweep_id='{sweep_id}'", "-m")
    results = pd.read_csv(run_cli.tmp / "sweep" / "results.csv")
    assert sorted(results["N"].unique()) == [40, 60], proc.stderr[-2000:]
    records = [json.loads(p.read_text()) for p in (run_cli.tmp / "sweep").glob("*/cell.json")]
    assert [r["sweep"] for r in records] == [sweep_id, sweep_id]


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["cut_mid_row", "emptied"])
def test_resume_reruns_a_cell_whose_results_were_damaged(tmp_path, damage):
    """A resumed sweep re-checks each finished cell's results.csv against the hash its cell recorded:
    a file cut mid-row or emptied since is run again, never silently dropped nor a crash."""
    store, sweep = f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "sweep"
    common = merged(*TINY, f"mlflow.tracking_uri={store}", f"hydra.sweep.dir={sweep}", "regime.N=40,60")
    proc = cli(*common, "-m")
    assert proc.returncode == 0, proc.stderr[-3000:]
    whole = (sweep / "results.csv").read_bytes()
    victim = sweep / "1" / "results.csv"  # the N = 60 cell's (job 1)
    text = victim.read_bytes()
    victim.write_bytes(text[: len(text) * 2 // 3] if damage == "cut_mid_row" else b"")
    proc = cli(*common, "hydra.sweeper.resume=true", "-m")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "not what its cell wrote" in proc.stderr + proc.stdout
    assert (sweep / "results.csv").read_bytes() == whole  # the cell ran again, to the same numbers
    assert victim.read_bytes() == text


@pytest.mark.slow
def test_a_second_sweep_into_a_folder_in_use_is_refused(tmp_path):
    """Two sweeps into one hydra.sweep.dir at once would overwrite each other's summary: the second
    is refused with one error line (exit 2) while the first holds the folder; the first is unharmed."""
    import subprocess
    import sys
    import time

    store, sweep = f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "sweep"
    args = [f"mlflow.tracking_uri={store}", f"hydra.sweep.dir={sweep}", "dataset.n_test=10", "regime.N=40",
            "method=[ridge,noisyhead]"]
    first = subprocess.Popen([sys.executable, "-m", "pipeline", *args, "trials=2", "seed=0,1,2,3,4,5", "-m"],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not (sweep / ".sweep.lock").exists() or not (sweep / ".sweep.lock").read_text().strip():
        assert time.time() < deadline and first.poll() is None, "the first sweep did not start"
        time.sleep(0.2)
    second = cli(*args, "trials=3", "seed=0,1", "-m")
    assert first.poll() is None, "the first sweep ended before the second was tried: the test proves nothing"
    assert second.returncode == 2, second.stderr[-3000:]
    [line] = error_lines(second)
    assert line.startswith("error: hydra.sweep.dir") and "in use by another sweep" in line and str(first.pid) in line
    out, err = first.communicate(timeout=600)
    assert first.returncode == 0, err[-3000:]
    assert sorted(pd.read_csv(sweep / "results.csv")["seed"].unique()) == [0, 1, 2, 3, 4, 5]


def test_the_cell_count_is_computed_without_listing_the_cells():
    """A sweep's size before any cell is composed: ranges counted by arithmetic (a 10-billion range
    filled the memory), a key given again replaces its values (the default grid's regime.N by the
    command line's), glob and plain values as Hydra reads them."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from hydra_plugins.pipeline_sweeper.validating_sweeper import cell_count

    def count(*args):
        return cell_count(OverridesParser.create().parse_overrides(list(args)))

    assert count("seed=range(0,10000000000)", "regime.N=1000,2000,4000") == 3 * 10**10
    assert count("regime.N=1,2,3,4,5,6,7", "seed=range(0,100)", "regime.N=1000,2000") == 200
    assert count("seed=range(1,10,4)", "privacy.eps=0.5", "trials=3") == 3  # 1, 5, 9
    assert count("seed=range(5,5)") == 0 and count("trials=3") == 1
    assert count("lr=range(0.1,1.0,0.3)") == len([0.1, 0.4, 0.7])
    assert count("lr=interval(0,1)", "seed=1,2") == 2  # left to split_arguments, which refuses it as before
