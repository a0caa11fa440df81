"""pipeline/collector.py: a single run holds the garbage collector off while it starts, its cell's MLflow
run turns it back on with the start-up's objects frozen, a sweep never holds it, and the heap is frozen
at exit. Each test leaves the collector as it found it."""

from __future__ import annotations

import atexit
import gc
import subprocess
import sys

import mlflow
import pytest
from conftest import ROOT

from pipeline import collector, tracking


@pytest.fixture(autouse=True)
def restored(monkeypatch):
    monkeypatch.setattr(collector, "_held", False)
    was = gc.isenabled()
    yield
    atexit.unregister(gc.freeze)
    gc.unfreeze()
    (gc.enable if was else gc.disable)()


def test_hold_then_release_freezes_what_exists_and_collects_again():
    collector.hold()
    assert not gc.isenabled()
    made = [[] for _ in range(1000)]  # objects of the start-up
    frozen = gc.get_freeze_count()
    collector.release()
    assert gc.isenabled()
    assert gc.get_freeze_count() >= frozen + len(made)  # frozen: no collection walks them again
    cycle = []
    cycle.append(cycle)  # the cell's own garbage is collected as before
    del cycle
    assert gc.collect() >= 1
    again = gc.get_freeze_count()
    collector.release()  # released once: a second call changes nothing
    assert gc.isenabled() and gc.get_freeze_count() == again


def test_a_collector_turned_off_elsewhere_stays_off():
    gc.disable()
    collector.hold()
    collector.release()
    assert not gc.isenabled()


@pytest.mark.parametrize("argv, held", [
    (["trials=100"], True),
    ([], True),
    (["-m", "regime.N=1000,2000"], False),
    (["regime.N=1000,2000", "--multirun"], False),
    (["hydra.mode=MULTIRUN", "regime.N=1000,2000"], False),
    (["+hydra.mode=MULTIRUN"], False),
])
def test_start_holds_a_single_run_and_never_a_sweep(argv, held):
    gc.enable()
    collector.start(argv)
    assert gc.isenabled() is not held


def test_the_cells_run_releases_the_collector(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    try:
        mlflow.set_experiment("collector")
        collector.hold()
        with tracking.run("cell", {}):
            assert gc.isenabled()
    finally:
        mlflow.set_tracking_uri(None)


@pytest.mark.slow
def test_a_process_frozen_at_exit_still_runs_its_exit_handlers_and_flushes(tmp_path):
    """Freezing at exit skips the interpreter's last collections, not what a process owes: exit handlers
    registered before and after run (in reverse order), buffered stdout and an unclosed file reach disk."""
    unclosed = tmp_path / "unclosed.txt"
    code = f"""
import atexit, gc, sys
atexit.register(print, "registered before")
from pipeline import collector
collector.start(["trials=100"])
atexit.register(print, "registered after")
assert not gc.isenabled()
handle = open({str(unclosed)!r}, "w")
handle.write("written, never closed")
sys.stdout.write("buffered, never flushed")
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "buffered, never flushedregistered after\nregistered before\n"
    assert unclosed.read_text() == "written, never closed"
