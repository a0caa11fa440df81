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
