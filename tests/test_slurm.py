"""Sweeps through a real SLURM cluster (``hydra/launcher=submitit_slurm``): the one-node cluster of
``.ci/slurm`` (Debian's slurm-wlm with accounting), started for this module and stopped after it,
even when a test fails. Where it cannot start (not root, no apt, a daemon that does not answer) the
tests are skipped with the harness's reason, never silently.

A sweep's cells run as SLURM array tasks; the submitting process waits for them and writes the
summary. Its ``results.csv`` must equal the default launcher's, byte for byte, and no MLflow run
may be left RUNNING."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

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
    cmd = [sys.executable, "-m", "pipeline", *args, f"hydra.sweep.dir={folder}", f"mlflow.tracking_uri={store}", "-m"]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=900)


def statuses(store: str) -> list[str]:
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=store)
    exps = client.search_experiments()
    return [r.info.status for r in client.search_runs([e.experiment_id for e in exps])] if exps else []


@pytest.mark.parametrize("args", [
    ["regime=highdim", "privacy.eps=0.1", "trials=20", "dataset.n_test=50"],
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
