"""The store writes are shielded from Ctrl-C and SIGTERM: a signal that arrives inside a write acts
after it, so the run's KILLED update never waits on a write lock its own process still holds."""

import ast
import re
import signal
from pathlib import Path

import mlflow
import pytest
import sqlalchemy
from conftest import ROOT
from omegaconf import OmegaConf

from pipeline import tracking


@pytest.fixture
def ctrl_c():
    """Python's Ctrl-C handler for SIGINT while a test runs: a pytest started in the background
    (nohup, `&` without job control) inherits SIGINT ignored, and Python then installs no handler,
    so a raised SIGINT did nothing and these tests failed for how they were launched."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def test_a_signal_inside_a_shield_acts_when_the_block_ends(ctrl_c):
    done = []
    with pytest.raises(KeyboardInterrupt):
        with tracking.shielded():
            signal.raise_signal(signal.SIGINT)
            done.append("after the signal")  # not interrupted
    assert done == ["after the signal"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored


def test_nested_shields_defer_to_the_outermost_and_sigterm_stays_terminated():
    done = []
    with pytest.raises(tracking.Terminated), tracking.sigterm_raises():
        with tracking.shielded():
            with tracking.shielded():
                signal.raise_signal(signal.SIGTERM)
            done.append("inner ended")  # the outer shield still holds it
    assert done == ["inner ended"]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


@pytest.mark.slow
def test_ctrl_c_inside_a_store_write_ends_the_run_killed_with_the_write_whole(tmp_path, monkeypatch, ctrl_c):
    """Ctrl-C delivered while a metric write is inside its sqlite transaction (raised from the
    statement itself). Unshielded, this write is lost; in CI the interrupt landed later in such a
    transaction, MLflow's store kept sqlite's write lock, and the KILLED update failed with
    "database is locked" after 20 s, leaving the run RUNNING."""
    monkeypatch.chdir(tmp_path)
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow.set_tracking_uri(store)
    mlflow.set_experiment("shield")
    fired = []

    def interrupt(conn, cursor, statement, parameters, context, executemany):
        if statement.lstrip().upper().startswith("INSERT INTO METRICS") and not fired:
            fired.append(statement)
            signal.raise_signal(signal.SIGINT)

    sqlalchemy.event.listen(sqlalchemy.engine.Engine, "before_cursor_execute", interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            with tracking.run("interrupted", {}) as active:
                tracking.log_metrics("train", {"loss": 1.5}, at=3)
                pytest.fail("the interrupt must act when the write ends")
    finally:
        sqlalchemy.event.remove(sqlalchemy.engine.Engine, "before_cursor_execute", interrupt)
        mlflow.set_tracking_uri(None)
    assert fired
    run = mlflow.MlflowClient(store).get_run(active.info.run_id)
    assert run.info.status == "KILLED"
    assert run.data.metrics == {"train.loss": 1.5}


WRITES = re.compile(r"\bmlflow\.(log_\w+|set_tags?|start_run|end_run|delete_\w+)\(|"
                    r"\bclient\.(log_\w+|set_\w+|create_\w+|delete_\w+)\(")


def test_every_store_write_goes_through_tracking():
    """Writes outside ``pipeline/tracking.py`` would not be shielded."""
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
             for folder in ("pipeline", "hydra_plugins") for path in sorted((ROOT / folder).rglob("*.py"))
             if path != ROOT / "pipeline" / "tracking.py"
             for n, line in enumerate(path.read_text().splitlines(), 1) if WRITES.search(line)]
    assert found == []
    assert WRITES.search('        mlflow.log_artifact(str(fig))')  # the pattern sees what it must


def test_tracking_writes_are_shielded():
    """Each function of ``tracking`` that writes to the store is decorated ``@shielded()`` or
    ``@_to_active_run`` (shielded too), or writes inside ``with ... shielded()`` (a new helper must be too)."""
    source = Path(tracking.__file__).read_text()
    unshielded = []
    for node in ast.parse(source).body:
        if not isinstance(node, ast.FunctionDef):
            continue
        text = ast.get_source_segment(source, node)
        decorated = any(ast.unparse(d) in ("shielded()", "_to_active_run") for d in node.decorator_list)
        if WRITES.search(text) and not decorated and "shielded():" not in text:
            unshielded.append(node.name)
    assert unshielded == []


def test_a_step_called_outside_a_run_logs_nothing_and_starts_no_run(tmp_path, monkeypatch):
    """``data.run`` or ``train.run`` called from a test or a notebook: MLflow's fluent API would
    start a run in ./mlflow.db for the first write and leave it RUNNING."""
    monkeypatch.chdir(tmp_path)
    tracking.log_params("data", {"seed": 0})
    tracking.log_metrics("train", {"loss": 1.0}, at=1)
    tracking.log_curve("train.loss", [1.0, 0.5])
    tracking.log_headline_params({"N": 10})
    tracking.log_headline_metrics({"risk": 0.5})
    tracking.set_tag("verdict", "pass")
    assert mlflow.active_run() is None
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "mlruns").exists()


@pytest.mark.slow
def test_a_single_run_folder_in_use_by_another_process_is_refused(tmp_path):
    """Two copies of one single-run command in one folder: the second is refused (ConfigError naming
    the folder and the holder's pid) instead of marking the first's run FAILED; the lock goes with
    the holder, even when it is killed."""
    import subprocess
    import sys

    from pipeline.validation import ConfigError

    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                               "from pipeline import tracking; tracking._hold_run_folder(Path(sys.argv[1])); "
                               "print('held', flush=True); time.sleep(60)", str(tmp_path)],
                              cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match=rf"hydra.run.dir = '{tmp_path}' is in use by another run \(pid {holder.pid}\)"):
            tracking._hold_run_folder(tmp_path)
    finally:
        holder.kill()
        holder.wait()
    tracking._hold_run_folder(tmp_path)  # SIGKILL released it
    tracking._hold_run_folder(tmp_path)  # this process again: no conflict with itself
    tracking._HELD.pop(tmp_path.resolve()).close()


def _full_disk_at(prefix: str):
    """A sqlalchemy hook raising sqlite's own full-disk error for statements starting with ``prefix``
    (what a disk that fills mid-run does to each later write), and the list of those it stopped."""
    import sqlite3

    stopped = []

    def refuse(conn, cursor, statement, parameters, context, executemany):
        if statement.lstrip().upper().startswith(prefix):
            stopped.append(statement)
            raise sqlite3.OperationalError("database or disk is full")

    return refuse, stopped


@pytest.mark.parametrize("prefix, recorded", [("INSERT INTO PARAMS", True), ("UPDATE RUNS", False)])
def test_a_store_whose_disk_fills_mid_run_is_one_enospc_and_the_run_ends_failed_if_it_can(
        tmp_path, monkeypatch, caplog, prefix, recorded):
    """Issue 73: the store's disk filled during a run: MLflow's chained tracebacks, the run left
    RUNNING without a reason. Now a write that finds the disk full is ``OSError(ENOSPC)`` naming the
    store (the entry point's one line), the run ends FAILED with that reason, and when even the run's
    end cannot be written (``UPDATE runs``) the run's id is kept for the error line, with no traceback
    logged by MLflow."""
    import errno

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tracking, "run_unrecorded", None)
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow.set_tracking_uri(store)
    mlflow.set_experiment("full")
    refuse, stopped = _full_disk_at(prefix)
    sqlalchemy.event.listen(sqlalchemy.engine.Engine, "before_cursor_execute", refuse)
    try:
        with pytest.raises(OSError) as raised:
            with tracking.run("filled", {}) as active:
                tracking.log_params("data", {"seed": 0})
                if recorded:
                    pytest.fail("the write must raise")
    finally:
        sqlalchemy.event.remove(sqlalchemy.engine.Engine, "before_cursor_execute", refuse)
        mlflow.set_tracking_uri(None)
    assert stopped
    assert raised.value.errno == errno.ENOSPC and raised.value.filename == store
    assert raised.value.__cause__ is None and (raised.value.__context__ is None or raised.value.__suppress_context__)
    assert not [r for r in caplog.records if r.name.startswith("mlflow") and r.levelname == "ERROR"]
    run = mlflow.MlflowClient(store).get_run(active.info.run_id)
    if recorded:
        assert run.info.status == "FAILED" and tracking.run_unrecorded is None
        assert run.data.tags["failed_reason"] == str(raised.value)
    else:
        assert run.info.status == "RUNNING" and tracking.run_unrecorded == active.info.run_id
        assert mlflow.active_run() is None  # MLflow will not try (and fail) again at exit


def test_the_full_disk_line_says_whether_the_run_was_recorded(monkeypatch):
    import errno

    from pipeline.__main__ import full_disk

    err = OSError(errno.ENOSPC, "the MLflow store's disk is full", "sqlite:///x.db")
    monkeypatch.setattr(tracking, "run_unrecorded", None)
    assert "a run it hit ended FAILED with this reason" in full_disk(err)
    monkeypatch.setattr(tracking, "run_unrecorded", "abc123")
    line = full_disk(err)
    assert "could not record the end of run abc123" in line and "next launch" in line and "x.db" in line


@pytest.mark.slow
def test_a_store_on_a_disk_that_fills_mid_run_is_one_error_line(tmp_path):
    """The issue's case for real (root only, where a small tmpfs can be mounted): the store's disk
    is filled to the last block when the run logs its config, after the run began. One ``error:``
    line, exit 1, no traceback; the next launch ends the run FAILED saying why it may have stopped."""
    import subprocess
    import sys
    import os

    from conftest import ROOT

    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(disk)],
                                           capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here")
    launcher = tmp_path / "launch.py"
    launcher.write_text(f'''import runpy, sys
import mlflow
log_text = mlflow.log_text
def filling(*a, **k):
    mlflow.log_text = log_text
    with open({str(disk / "fill")!r}, "wb") as f:
        try:
            while True:
                f.write(bytes(65536)); f.flush()
        except OSError:
            pass
    return log_text(*a, **k)
mlflow.log_text = filling
sys.argv = ["pipeline"] + sys.argv[1:]
runpy.run_module("pipeline", run_name="__main__", alter_sys=True)
''')
    store = f"sqlite:///{disk / 'mlflow.db'}"
    try:
        proc = subprocess.run([sys.executable, str(launcher), "trials=2", f"mlflow.tracking_uri={store}",
                               f"hydra.run.dir={tmp_path / 'run'}"], cwd=ROOT, capture_output=True, text=True,
                              timeout=300)
        (disk / "fill").unlink()
        mlflow.set_tracking_uri(store)
        client = mlflow.MlflowClient(store)
        tracking.reap(OmegaConf.create({}))
        runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    finally:
        mlflow.set_tracking_uri(None)
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)  # lazily: this process's store may hold it
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 1 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert errors[0].startswith("error: no space left on the device writing sqlite:///") and "free some space" in errors[0]
    assert not (tmp_path / "run").exists()  # stopped before writing anything: no folder left (nor its lock)
    assert len(runs) == 1 and runs[0].info.status == "FAILED"
    assert "store's disk was full" in runs[0].data.tags["failed_reason"] or \
        "disk is full" in runs[0].data.tags["failed_reason"]
