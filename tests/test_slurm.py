"""Sweeps through a real SLURM cluster (``hydra/launcher=submitit_slurm``): the one-node cluster of
``.ci/slurm`` (Debian's slurm-wlm with accounting), started for this module and stopped after it,
even when a test fails. Where it cannot start (not root, no apt, a daemon that does not answer) the
tests are skipped with the harness's reason, never silently.

A sweep's cells run as SLURM array tasks; the submitting process waits for them and writes the
summary. Its ``results.csv`` must equal the default launcher's, byte for byte, and no MLflow run
may be left RUNNING."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import forkserver
import pandas as pd
import pytest
from conftest import communicate_or_kill, merged

# One test cluster for the module, whose tests check that its queue ends empty: under pytest-xdist
# they all run on one worker (--dist loadgroup), never beside each other.
pytestmark = pytest.mark.xdist_group("slurm")

ROOT = Path(__file__).resolve().parents[1]
HARNESS = ROOT / ".ci" / "slurm"
SLURM = ["hydra/launcher=submitit_slurm", "hydra.launcher.partition=debug", "hydra.launcher.timeout_min=10",
         "hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_gb=2"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """SLURM_CONF of a running test cluster: started here (and stopped after the module) unless one
    already answers (then left running, as found)."""
    env = dict(os.environ, SLURM_TEST_DIR=str(os.environ.get("SLURM_TEST_DIR", "/tmp/pipeline-slurm")))
    was_up = subprocess.run([str(HARNESS), "status"], env=env, capture_output=True, text=True).returncode == 0
    proc = subprocess.run([str(HARNESS), "up"], env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        pytest.skip(f"no SLURM test cluster: {proc.stderr.strip()[-500:] or proc.stdout.strip()[-500:]}")
    conf = proc.stdout.strip().splitlines()[-1].split("=", 1)[1]
    try:
        yield conf
    finally:
        if not was_up:
            subprocess.run([str(HARNESS), "down"], env=env, capture_output=True, text=True, timeout=300)


def sweep(args, folder: Path, store: str, conf: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    if conf:
        env["SLURM_CONF"] = conf
    args = ["-m", "pipeline", *args, f"hydra.sweep.dir={folder}", f"mlflow.tracking_uri={store}", "-m"]
    return forkserver.run(args, cwd=ROOT, env=env, timeout=900)  # the submitting process, forked: tests/forkserver.py


def statuses(store: str) -> list[str]:
    return [r.info.status for r in runs(store)]


@pytest.mark.slow
@pytest.mark.parametrize("args", [
    ["regime=highdim", "regime.N=500,1000", "privacy.eps=0.1", "trials=20", "dataset.n_test=50"],  # 2 of its 6 N
    ["experiment=dpformer_ci", "dataset.n_users=80", "dataset.L=10", "seqrec.batch_size=40", "seqrec.epochs=1",
     "seed=0,1"],
], ids=["noisyhead", "seqrec"])
def test_a_sweep_through_slurm_equals_the_default_launchers(cluster, tmp_path, args):
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    local = sweep(args, tmp_path / "local", store)
    assert local.returncode == 0, local.stderr[-3000:]
    slurm = sweep([*args, *SLURM], tmp_path / "slurm", store, cluster)
    assert slurm.returncode == 0, slurm.stderr[-3000:]
    jobs = list((tmp_path / "slurm" / ".submitit").glob("*"))
    assert jobs, "no submitit job folder: the cells did not go through SLURM"
    a, b = (tmp_path / "local" / "results.csv").read_bytes(), (tmp_path / "slurm" / "results.csv").read_bytes()
    assert a == b
    assert statuses(store) and set(statuses(store)) == {"FINISHED"}


# --- cells that end without their result ---------------------------------------------------------

CELL = ["experiment=dpformer_ci", "dataset.n_users=80", "dataset.L=10", "seqrec.batch_size=40"]


def launch(args, folder: Path, store: str, conf: str, log: Path | None = None) -> subprocess.Popen:
    """The sweep, started in its own session; its stdout and stderr piped, or both written to ``log``
    (to be read while it runs)."""
    runs(store)  # create the store's tables before the sweep does: two processes creating them at once break it
    env = dict(os.environ, PYTHONWARNINGS="ignore", SLURM_CONF=conf)
    cmd = [sys.executable, "-m", "pipeline", *merged(*SLURM, *args), f"hydra.sweep.dir={folder}",
           f"mlflow.tracking_uri={store}", "-m"]
    if log is None:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, text=True, start_new_session=True, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
    with log.open("w") as out:  # the sweep holds its own copy
        return subprocess.Popen(cmd, cwd=ROOT, env=env, text=True, start_new_session=True, stdout=out,
                                stderr=subprocess.STDOUT)


def wait_for(what: str, check, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f} s"
        time.sleep(1)


def runs(store: str) -> list:
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=store)
    try:
        exps = client.search_experiments()
        return client.search_runs([e.experiment_id for e in exps]) if exps else []
    except Exception:  # the store is being created by the sweep
        return []


def array_task(folder: Path, task: int) -> str:
    found = [p.name for p in (folder / ".submitit").glob(f"*_{task}")]
    assert len(found) == 1, found
    return found[0]


def queue(conf: str, fmt: str = "%i") -> list[str]:
    out = subprocess.run(["squeue", "-h", "-r", "-o", fmt], env=dict(os.environ, SLURM_CONF=conf),
                         capture_output=True, text=True)
    return out.stdout.split() if fmt == "%i" else out.stdout.splitlines()


def assert_queue_drains(conf: str, job: str | None = None, timeout: float = 120.0) -> None:
    """The queue empties (of ``job``, or of every job): a job whose result the sweep has read, or
    that sacct reports cancelled or timed out, can still be listed a while (COMPLETING: its
    processes being killed, its epilog run; on a loaded machine for tens of seconds, which failed CI
    twice). A job still listed after ``timeout`` is an orphan."""
    left = lambda: [j for j in queue(conf) if job is None or j == job]  # noqa: E731
    deadline = time.monotonic() + timeout
    while left() and time.monotonic() < deadline:
        time.sleep(1)
    assert not left(), f"jobs left in the queue after {timeout:.0f} s: {queue(conf, '%i %T %M')}"


def assert_cell_0_failed_alone(proc: subprocess.Popen, folder: Path, store: str, conf: str,
                               log: Path | None = None) -> None:
    """Await the sweep (killed if it hangs) and check that cell 0 (seqrec.epochs=100000) is reported
    failed while cell 1 (1 epoch) was summarised, with no run left RUNNING and the queue empty."""
    out, err = communicate_or_kill(proc, 400)
    if log is not None:
        err = log.read_text()
    assert proc.returncode == 1, err[-3000:]
    assert "1 of 2 cells failed" in err and "seqrec.epochs=100000" in err, err[-3000:]
    results = pd.read_csv(folder / "results.csv")
    assert len(results) > 0 and set(results["epochs"]) == {1}
    found = sorted(r.info.status for r in runs(store))
    assert "RUNNING" not in found and found.count("FINISHED") == 2, found  # cell 1 and the parent
    assert_queue_drains(conf)


@pytest.mark.slow
def test_a_cancelled_cell_fails_alone_and_the_others_are_awaited(cluster, tmp_path):
    """Cell 0 runs without end and is cancelled with scancel while it runs; cell 1's job waits in its
    setup until the sweep has said that cell 0 ended without its result (the test then lets it go),
    so it is still to come when submitit learns of the cancel. The sweep must await it: one cell
    failed, the other summarised, nothing RUNNING. (Before the fix the sweep ended at the cancel and
    reported both cells failed. Cell 1 used to sleep a minute instead: longer, and not a proof.)"""
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    folder, log, go = tmp_path / "sweep", tmp_path / "sweep.log", tmp_path / "go"
    setup = f"while [ $SLURM_ARRAY_TASK_ID = 1 ] && [ ! -e {go} ]; do sleep 1; done"
    proc = launch([*CELL, "seqrec.epochs=100000,1", f"hydra.launcher.setup=['{setup}']"], folder, store, cluster, log)
    try:
        wait_for("cell 0's run RUNNING", lambda: any(r.info.status == "RUNNING" for r in runs(store)))
        subprocess.run(["scancel", array_task(folder, 0)], env=dict(os.environ, SLURM_CONF=cluster), check=True)
        wait_for("the sweep's word that cell 0 ended without its result",
                 lambda: f"job {array_task(folder, 0)} (CANCELLED" in log.read_text())
        assert not (folder / "1" / "results.csv").exists()  # cell 1 is still to come
        go.touch()
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    assert_cell_0_failed_alone(proc, folder, store, cluster, log)


@pytest.mark.slow
def test_a_cell_past_its_time_limit_fails_alone(cluster, tmp_path):
    """A two-minute limit: cell 0 (without end) is stopped at it, cell 1 finishes and is summarised.
    Both cells share the limit, so cell 1 must end before it on a loaded machine too: SLURM counts
    from the allocation (before Python has started) and checks limits every 30 s or so, and with a
    one-minute limit and a 20 s signal delay the signal came 16 s and 34 s into the 1-epoch cell
    under load. Two minutes and a 10 s delay leave that cell about 80 s at the least."""
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    folder = tmp_path / "sweep"
    proc = launch([*CELL, "seqrec.epochs=100000,1", "hydra.launcher.timeout_min=2",
                   "hydra.launcher.signal_delay_s=10"], folder, store, cluster)
    assert_cell_0_failed_alone(proc, folder, store, cluster)


@pytest.mark.slow
def test_resume_after_the_submitter_is_killed(cluster, tmp_path):
    """The submitting process is killed (SIGKILL) once cell 0 finished, while cell 1's job still
    waits in its setup. ``hydra.sweeper.resume=true`` into the same folder cancels that orphan job,
    keeps cell 0 (no second run of it), runs cell 1 and summarises both: results equal to the default
    launcher's, every run FINISHED, the queue empty."""
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    folder = tmp_path / "sweep"
    args = [*CELL, "seqrec.epochs=1", "seed=0,1"]
    proc = launch([*args, "hydra.launcher.setup=['sleep $((SLURM_ARRAY_TASK_ID * 600))']"], folder, store, cluster)
    try:
        wait_for("cell 0 FINISHED", lambda: any(r.info.status == "FINISHED" for r in runs(store)))
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
    orphan = array_task(folder, 1)
    assert orphan in queue(cluster)
    resumed = launch([*args, "hydra.sweeper.resume=true"], folder, store, cluster)
    out, err = resumed.communicate(timeout=400)
    assert resumed.returncode == 0, err[-3000:]
    assert "cancelled 1 SLURM job(s) of an earlier launch" in out and orphan in out, out[-3000:]
    assert_queue_drains(cluster, orphan)
    local = sweep(args, tmp_path / "local", f"sqlite:///{tmp_path / 'local.db'}")
    assert local.returncode == 0, local.stderr[-3000:]
    assert (folder / "results.csv").read_bytes() == (tmp_path / "local" / "results.csv").read_bytes()
    cells = [r for r in runs(store) if r.data.tags.get("kind") == "cell"]
    assert sorted(r.info.status for r in cells) == ["FINISHED", "FINISHED"]  # cell 0 ran once
    assert {r.info.status for r in runs(store)} == {"FINISHED"}


class _Job:
    """A submitit job as ``submitit_jobs._await`` sees it (no cluster needed)."""

    def __init__(self, done: bool, state: str):
        self.job_id, self._done, self.state = "7_1", done, state

    def done(self):
        return self._done

    def submission(self):
        return type("Submission", (), {"args": (["seed=1"], "hydra.sweep.dir", 1)})()


@pytest.mark.slow
def test_a_gpu_sweep_is_submitted_from_a_machine_without_one_and_checked_on_its_node(cluster, tmp_path):
    """``compute.device=cuda`` under SLURM: the submitting machine (no GPU here, as login nodes often
    have none) checks the device's form only and submits; the node checks its own device. The test
    cluster's node has no GPU either, so there the cell is refused with its one error line: the
    sweep reports the cell failed (the node's error in the job's log), and nothing is left RUNNING.
    (Before, the submitting machine refused the whole sweep: torch sees no CUDA device there.)"""
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    folder = tmp_path / "sweep"
    proc = sweep([*CELL, "seqrec.epochs=1", "compute.device=cuda", *SLURM], folder, store, cluster)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "1 of 1 cells failed" in proc.stderr, proc.stderr[-3000:]
    assert list((folder / ".submitit").glob("*")), "not submitted"
    logs = "".join(p.read_text(errors="replace") for p in (folder / ".submitit").rglob("*.err"))
    assert "error: compute.device = 'cuda': torch sees no CUDA device" in logs, logs[-3000:]
    assert "RUNNING" not in statuses(store)
    assert_queue_drains(cluster)


def test_a_job_without_its_result_becomes_a_failed_cell_not_an_exception():
    from submitit.core.utils import UncompletedJobError

    from hydra_plugins.pipeline_sweeper import submitit_jobs

    def original(job):
        raise UncompletedJobError("has not produced any output (state: CANCELLED)")

    [ret] = submitit_jobs._await(_Job(done=True, state="CANCELLED"), original)
    assert ret.status.name == "FAILED" and ret.overrides == ["seed=1"]
    assert isinstance(ret._return_value, UncompletedJobError)
    assert submitit_jobs._await(_Job(done=True, state="COMPLETED"), lambda job: ["ok"]) == ["ok"]


def test_a_job_that_vanished_from_the_cluster_is_failed_after_a_bounded_wait(monkeypatch):
    """SLURM 22.05 keeps no sacct record of an array task cancelled while PENDING: submitit sees it
    UNKNOWN for ever. Once squeue no longer lists it either, the wait ends after VANISHED_S."""
    from hydra_plugins.pipeline_sweeper import submitit_jobs

    monkeypatch.setattr(submitit_jobs, "VANISHED_S", 0.3)
    monkeypatch.setattr(submitit_jobs, "POLL_S", 0.05)
    monkeypatch.setattr(submitit_jobs.shutil, "which", lambda cmd: "/usr/bin/" + cmd)
    queued = {"7_1"}
    monkeypatch.setattr(submitit_jobs, "_queued", lambda ids: queued & set(ids))
    job = _Job(done=False, state="UNKNOWN")
    start = time.monotonic()
    queued.clear()  # gone from squeue too
    [ret] = submitit_jobs._await(job, lambda job: pytest.fail("results of a vanished job"))
    assert ret.status.name == "FAILED" and "without a result or an accounting record" in str(ret._return_value)
    assert 0.3 <= time.monotonic() - start < 5
