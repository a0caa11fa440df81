"""A language-model cell across processes (``train.distributed=ddp``, pipeline/lm/ranks.py): refused
where it cannot run (outside torchrun, one of several processes without it, a sweep, the audit, FSDP),
before any folder or store; and, marked slow, under ``torchrun`` with two processes on the CPU: one
MLflow run and one folder (rank 0's), its results those of one process to float tolerance, and a
relaunch after SIGKILL continuing from rank 0's checkpoint on both ranks."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time

import pandas as pd
import pytest
import torch

from pipeline.lm import ranks
from pipeline.validation import ConfigError

from conftest import ROOT, communicate_or_kill


@pytest.fixture
def outside_torchrun(monkeypatch):
    for key in ranks.TORCHRUN:
        monkeypatch.delenv(key, raising=False)


@pytest.fixture
def inside_torchrun(monkeypatch):
    for key, value in zip(ranks.TORCHRUN, ("0", "2", "0", "127.0.0.1", "29511")):
        monkeypatch.setenv(key, value)


@pytest.mark.parametrize("value,message", [
    ("ddp", "runs under torchrun, which sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT for each "
            "process; none set here"),
    ("fsdp", "sharding by FSDP2 is the trainer's"),
    ("nccl", "must be null (one process) or 'ddp'"),
])
def test_a_distributed_cell_outside_torchrun_or_of_another_mode_is_refused(cfg_for, outside_torchrun, value, message):
    from pipeline.lm import config

    with pytest.raises(ConfigError, match="train.distributed") as refused:
        config.validate(cfg_for("experiment=lm_ci", f"train.distributed={value}"))
    assert message in str(refused.value)


def test_one_of_several_processes_without_it_is_refused(cfg_for, monkeypatch):
    from pipeline.lm import config

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="train.distributed = null in one of WORLD_SIZE = 2 processes"):
        config.validate(cfg_for("experiment=lm_ci"))
    monkeypatch.setenv("WORLD_SIZE", "1")  # torchrun with one process: one run, as without it
    assert config.validate(cfg_for("experiment=lm_ci")).distributed is None


def test_under_torchrun_the_cell_is_accepted_and_the_audit_refused(cfg_for, inside_torchrun):
    from pipeline.lm import audit, config

    assert config.validate(cfg_for("experiment=lm_ci", "train.distributed=ddp")).distributed == "ddp"
    with pytest.raises(ConfigError, match="the whole-run audit trains in one process"):
        audit.validate(cfg_for("experiment=lm_audit", "train.distributed=ddp"))


def test_a_sweep_under_torchrun_is_refused_before_any_folder_or_store(run_cli, inside_torchrun):
    proc = run_cli("experiment=lm_ci", "train.distributed=ddp", "model.tied=true,false", "-m", expect_ok=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "a sweep (-m) under torchrun would run every cell on every rank" in proc.stderr.strip().splitlines()[-1]
    assert not (run_cli.tmp / "sweep").exists() and not (run_cli.tmp / "mlflow.db").exists()


def _torchrun(tmp_path, *overrides: str, folder: str, start_new_session: bool = False) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "pipeline",
         "experiment=lm_ci", "train.distributed=ddp", "model.dropout=0", "compute.device=cpu",
         f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}", f"hydra.run.dir={folder}", *overrides],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"})


def _kill_tree(pid: int) -> None:
    """SIGKILL to ``pid`` and every process below it (read from /proc: torchrun's ranks are not in its group)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(entry))
    todo, tree = [pid], []
    while todo:
        tree.append(todo.pop())
        todo.extend(children.get(tree[-1], []))
    for p in reversed(tree):  # the ranks first: torchrun would otherwise see them die and report it
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _close(a: pd.DataFrame, b: pd.DataFrame, columns=("perplexity", "accuracy"), rel: float = 1e-4) -> None:
    keys = [k for k in ("method", "split", "epoch") if k in b]
    assert a[keys].equals(b[keys])
    for c in columns:
        assert ((a[c] - b[c]).abs() <= rel * b[c].abs()).all(), (c, a[c].tolist(), b[c].tolist())


@pytest.mark.slow
def test_under_torchrun_one_run_is_recorded_and_equals_one_process(tmp_path, run_cli):
    """Two processes (gloo): one folder and one FINISHED MLflow run, rank 0's, with the ranks in its params;
    the other rank silent; the results those of one process to float tolerance (the clipped sums are
    added in another order)."""
    import mlflow

    proc = _torchrun(tmp_path, folder=str(tmp_path / "runs" / "${uid:}"))
    out, err = communicate_or_kill(proc, 600)
    assert proc.returncode == 0, out[-2000:] + err[-3000:]
    folders = list((tmp_path / "runs").iterdir())
    assert len(folders) == 1, folders  # rank 1 dropped the folder Hydra made for it
    assert (out + err).count("preparing the data") == 1  # rank 1 says nothing
    client = mlflow.tracking.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    found = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    assert [(r.info.status, r.data.params.get("compute.ranks")) for r in found] == [("FINISHED", "2")]
    one = run_cli("experiment=lm_ci", "model.dropout=0", "compute.device=cpu")
    assert one.returncode == 0
    _close(pd.read_csv(folders[0] / "results.csv"), pd.read_csv(run_cli.tmp / "run" / "results.csv"))
    _close(pd.read_csv(folders[0] / "history.csv"), pd.read_csv(run_cli.tmp / "run" / "history.csv"),
           columns=("loss", "valid_perplexity"))


@pytest.mark.slow
def test_under_torchrun_a_killed_cell_relaunched_continues_from_rank_0s_checkpoint(tmp_path, run_cli):
    """SIGKILL to torchrun and its ranks once rank 0 wrote the first epoch's checkpoint; the same command
    again: both ranks continue from it (rank 0 reads it and sends its state), and the run ends with one
    process's uninterrupted results to float tolerance, its checkpoint gone."""
    from pipeline import checkpoints

    folder = tmp_path / "run2"
    proc = _torchrun(tmp_path, "train.epochs=4", folder=str(folder))
    deadline = time.time() + 400
    while not (folder / checkpoints.NAME).exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    _kill_tree(proc.pid)  # torchrun starts each rank in a session of its own
    proc.communicate()
    assert not (folder / "results.csv").exists(), "the run finished before it could be killed"
    stopped = torch.load(io.BytesIO(checkpoints.read(folder / checkpoints.NAME)), weights_only=True)["epoch"]
    assert 1 <= stopped < 4
    again = _torchrun(tmp_path, "train.epochs=4", folder=str(folder))
    out, err = communicate_or_kill(again, 600)
    assert again.returncode == 0, out[-2000:] + err[-3000:]
    assert f"continuing from epoch {stopped + 1}" in out + err
    assert not (folder / checkpoints.NAME).exists()
    run_cli("experiment=lm_ci", "train.epochs=4", "model.dropout=0", "compute.device=cpu")
    _close(pd.read_csv(folder / "results.csv"), pd.read_csv(run_cli.tmp / "run" / "results.csv"))
