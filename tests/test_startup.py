"""benchmarks/startup.py: its refusals are refusals (else it would time a cell, or a crash), and its
floor process does the work it claims (a run in the store, a figure on disk), so that the floor it
prints is what a cell cannot skip."""

from __future__ import annotations

import mlflow
import pytest

from benchmarks import startup
from pipeline import preflight
from pipeline.overrides import unknown_key
from pipeline.validation import ConfigError


def _overrides(args: list[str]) -> list[str]:
    """A command's overrides, without the ``-m pipeline`` and the scratch folders."""
    return [a for a in args[2:] if not a.startswith(("mlflow.tracking_uri=", "hydra.run.dir="))]


def test_the_benchmarks_refusals_are_refused_naming_their_key(cfg_for, tmp_path):
    commands = startup.commands(tmp_path)
    refused = {name: _overrides(args) for name, args in commands.items() if name.startswith("refused")}
    assert len(refused) == 3
    key = refused["refused key (privacy.epss=1)"]
    assert "privacy.epss" in unknown_key(key)
    for name in ("refused value (privacy.eps=abc)", "refused path (dataset.archive)"):
        overrides = refused[name]
        assert unknown_key(overrides) is None  # not refused for its key: for its value
        cfg = cfg_for(*overrides, f"mlflow.tracking_uri=sqlite:///{tmp_path / 'm.db'}")
        with pytest.raises(ConfigError) as err:
            preflight.check(cfg, output=tmp_path / "run", key="hydra.run.dir")
        changed = overrides[-1].split("=")[0]
        assert changed in str(err.value), str(err.value)
    assert not (tmp_path / "m.db").exists() and not (tmp_path / "run").exists()  # refused before any store or folder


@pytest.mark.slow
def test_the_floor_process_makes_a_run_and_a_figure(tmp_path):
    steps, walls = startup.floor(tmp_path, repeats=1, collector="frozen", warm=False)
    assert list(steps) == ["torch", "hydra compose", "spent eps", "MLflow run", "figure"]
    assert all(s > 0 for s in steps.values()) and len(walls) == 1 and walls[0] > sum(steps.values())
    assert (tmp_path / "floor.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'floor.db'}")
    [run] = client.search_runs([client.get_experiment_by_name("floor").experiment_id])
    assert run.info.status == "FINISHED" and run.data.params == {"trials": "100"}
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["floor.txt"]
