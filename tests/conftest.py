import os
import signal
import subprocess
import sys
from pathlib import Path

import forkserver
import mlflow
import pytest
import torch
from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[1]
torch.set_num_threads(1)


# the suite's longest single tests (minutes each), started first so that they do not start last and
# leave one worker running alone at the end (pytest-xdist schedules groups first, then in this order)
LONGEST = ("tests/test_dvc.py::test_dvc_repro_builds_every_artifact_and_then_does_nothing",)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` run where torch sees a CUDA device and are skipped (counted) elsewhere.
    Under ``--dist loadgroup``, tests marked ``xdist_group`` get the group as their id's suffix, as
    pytest-xdist's own hook means to: with pytest 9 it sets ``item._nodeid``, which pytest no longer
    reads (the id is ``item._id``), so no group was ever kept on one worker (SLURM's tests shared
    their cluster concurrently, and a module fixture ran once per worker)."""
    _xdist_groups(config, items)
    items.sort(key=lambda item: not item.nodeid.startswith(LONGEST))  # stable: the rest keep their order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=f"needs CUDA: torch {torch.__version__} sees no CUDA device here")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


def _xdist_groups(config, items) -> None:
    if not getattr(config.option, "loadgroup", False):
        return
    try:
        from _pytest.nodeid import coerce_node_id  # pytest >= 9
    except ImportError:  # pytest 8: pytest-xdist's hook works
        return
    for item in items:
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                        for m in item.iter_markers("xdist_group")})
        if names and "@" not in item.nodeid:
            item._id = coerce_node_id(f"{item.nodeid}@{'_'.join(names)}")


SET_BY_IMPORTS = ("TORCHINDUCTOR_",)  # what a package sets in os.environ when a test first uses it: the fork server's
                                     # imports set the same (ForkServer.imported_env), so its requests still fork


@pytest.fixture(autouse=True)
def _startup_settings_restored():
    """No test may leave a start-up setting (thread counts, hash seed, paths, locale: forkserver's
    STARTUP_KEYS) changed in the process: every later test's command would then run in a fresh interpreter
    rather than forked, and a test that a child was forked would fail far from the cause (a benchmark run
    in-process once left OMP_NUM_THREADS=1 behind)."""
    before = forkserver._startup_env(dict(os.environ))
    yield
    after = forkserver._startup_env(dict(os.environ))
    for k in set(after) - set(before):  # set by torch itself on its first compile (the server's imports set it too)
        if k.startswith(SET_BY_IMPORTS):
            before[k] = after[k]
    if after != before:
        changed = sorted(k for k in {*before, *after} if before.get(k) != after.get(k))
        for k in changed:  # undone, so that only this test fails
            os.environ.pop(k, None) if k not in before else os.environ.__setitem__(k, before[k])
        pytest.fail(f"the test left start-up settings changed in os.environ: "
                    f"{', '.join(f'{k}: {before.get(k)!r} -> {after.get(k)!r}' for k in changed)}")


@pytest.fixture(autouse=True)
def _tracking_uri_restored():
    """Whatever MLflow tracking URI a test sets (``tracking.setup`` sets it process-wide) is undone
    after it, so that no test depends on the ones before it; and no test may leave an MLflow run
    active in the process (a step called outside a run once started one in ./mlflow.db)."""
    from mlflow.tracking._tracking_service import utils

    before = utils._tracking_uri  # None when unset (MLflow has no public getter that says so)
    yield
    active = mlflow.active_run()
    if utils._tracking_uri != before:
        mlflow.set_tracking_uri(before)
    if active is not None:
        pytest.fail(f"the test left MLflow run {active.info.run_id} ({active.info.run_name}) active")


@pytest.fixture
def cfg_for():
    """Compose the real config with overrides, as `python -m pipeline` would (``name="audit"``: as
    `python -m pipeline.audit` would)."""

    def make(*overrides: str, hydra: bool = False, name: str = "config"):
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            return compose(name, overrides=list(overrides), return_hydra_config=hydra)

    return make


def merged(*overrides: str) -> list[str]:
    """The overrides with each key once: a later value replaces an earlier one in its place (a base
    list and a test's own values; the command line refuses a key given twice with two values)."""
    out: dict[str, str] = {}
    for arg in overrides:
        key, sep, _ = arg.partition("=")
        out[key.lstrip("+~") if sep and not arg.startswith("-") else arg] = arg
    return list(out.values())


@pytest.fixture
def run_cli(tmp_path):
    """Run `python -m pipeline ...` into a temporary MLflow store and output folder (forked from a
    server that has the heavy packages imported: tests/forkserver.py; PIPELINE_TESTS_FORK=0 launches a
    fresh interpreter each time)."""
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"

    def run(*args: str, expect_ok: bool = True):
        cmd = ["-m", "pipeline", f"mlflow.tracking_uri={store}",
               f"hydra.run.dir={tmp_path / 'run'}", f"hydra.sweep.dir={tmp_path / 'sweep'}", *args]
        env = dict(os.environ, PYTHONWARNINGS="ignore")
        proc = forkserver.run(cmd, cwd=ROOT, env=env, timeout=600)
        if expect_ok:
            assert proc.returncode == 0, proc.stderr[-3000:]
        return proc

    run.store = store
    run.tmp = tmp_path
    return run


def communicate_or_kill(proc: subprocess.Popen, timeout: float) -> tuple[str, str]:
    """(stdout, stderr) of a process started in its own group; if it is still running after
    ``timeout`` seconds (or the wait fails), its whole group is killed, so no test leaves it behind."""
    try:
        return proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def killed_and_relaunched(tmp_path, overrides: list[str], checkpoint: str, epoch_of, epochs: int) -> None:
    """A single run through the CLI killed with SIGKILL once its first checkpoint exists, the same
    command again into its folder, and an uninterrupted run beside it: the relaunch says where it
    continues from, ends with the uninterrupted run's ``results.csv`` and ``history.csv`` bit for
    bit, and neither run leaves its checkpoint (``epoch_of(path)``: the epoch a checkpoint holds)."""
    import time

    import pandas as pd

    common = [sys.executable, "-m", "pipeline", *overrides, "compute.device=cpu",
              f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"]
    folder = tmp_path / "run"
    proc = subprocess.Popen([*common, f"hydra.run.dir={folder}"], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not (folder / checkpoint).exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (folder / "results.csv").exists(), "the run finished before it could be killed"
    stopped_at = epoch_of(folder / checkpoint)
    assert 1 <= stopped_at < epochs
    # the relaunch and the uninterrupted run are ordinary runs: forked (tests/forkserver.py), 7 s of imports less each
    again = forkserver.run([*common[1:], f"hydra.run.dir={folder}"], cwd=ROOT, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"continuing from epoch {stopped_at + 1}" in again.stdout + again.stderr
    whole = forkserver.run([*common[1:], f"hydra.run.dir={tmp_path / 'whole'}"], cwd=ROOT, timeout=600)
    assert whole.returncode == 0, whole.stderr[-2000:]
    assert pd.read_csv(folder / "results.csv").equals(pd.read_csv(tmp_path / "whole" / "results.csv"))
    assert pd.read_csv(folder / "history.csv").equals(pd.read_csv(tmp_path / "whole" / "history.csv"))
    assert not (folder / checkpoint).exists() and not (tmp_path / "whole" / checkpoint).exists()
