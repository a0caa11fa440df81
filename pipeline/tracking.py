"""The MLflow conventions, in one place.

- One MLflow run per cell (one Hydra job). Parameters and metrics carry the name
  of the step that produced them: ``data.*``, ``train.*``, ``evaluate.*``.
- The cells of one Hydra sweep share the tag ``sweep``; when the sweep ends, a
  parent run holds the sweep's ``results.csv`` and figure, and the cells are
  attached to it (``mlflow.parentRunId``), so the UI shows them side by side.
- A run that raises is ended as FAILED (KILLED on Ctrl-C or SIGTERM): none is left RUNNING.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import Iterator, Mapping

import mlflow
from mlflow.entities import Metric, RunStatus
from omegaconf import DictConfig

SWEEP_TAG = "sweep"
SWEEP_ENV = "PIPELINE_SWEEP_ID"


def setup(cfg: DictConfig) -> None:
    """Point MLflow at the configured store (null: MLflow's default, ./mlflow.db) and experiment."""
    if cfg.mlflow.tracking_uri:
        mlflow.set_tracking_uri(cfg.mlflow.tracking_uri)
    mlflow.set_experiment(cfg.mlflow.experiment)


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def run(name: str, tags: Mapping[str, str]) -> Iterator[mlflow.ActiveRun]:
    """An MLflow run that ends FINISHED, FAILED on an exception, or KILLED on Ctrl-C or SIGTERM
    (SIGTERM is turned into KeyboardInterrupt from before the run is created until it ends)."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _interrupt) if main else None
    try:
        yield mlflow.start_run(run_name=name, tags=dict(tags))
    except KeyboardInterrupt:
        if mlflow.active_run() is not None:
            mlflow.end_run(RunStatus.to_string(RunStatus.KILLED))
        raise
    except BaseException:
        if mlflow.active_run() is not None:
            mlflow.end_run(RunStatus.to_string(RunStatus.FAILED))
        raise
    else:
        mlflow.end_run(RunStatus.to_string(RunStatus.FINISHED))
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def sweep_id() -> str | None:
    return os.environ.get(SWEEP_ENV)


def log_params(step: str, params: Mapping[str, object]) -> None:
    mlflow.log_params({f"{step}.{k}": v for k, v in params.items()})


def log_metrics(step: str, metrics: Mapping[str, float], at: int | None = None) -> None:
    mlflow.log_metrics({f"{step}.{k}": float(v) for k, v in metrics.items()}, step=at)


def log_curve(key: str, values: list[float]) -> None:
    """A per-step metric in one request (the training loss can have hundreds of steps)."""
    run_id = mlflow.active_run().info.run_id
    now = int(time.time() * 1000)
    metrics = [Metric(key, float(v), now, i) for i, v in enumerate(values)]
    client = mlflow.MlflowClient()
    for start in range(0, len(metrics), 1000):
        client.log_batch(run_id, metrics=metrics[start : start + 1000])


def finish_sweep(sweep: str, name: str, artifacts: list[str], params: Mapping[str, object]) -> str:
    """Create the sweep's parent run, log its artifacts, and attach the sweep's cells to it."""
    with run(name, {SWEEP_TAG: sweep, "kind": "sweep"}) as parent:
        mlflow.log_params(params)
        for path in artifacts:
            mlflow.log_artifact(path)
        client = mlflow.MlflowClient()
        experiment = parent.info.experiment_id
        cells = client.search_runs(
            [experiment], filter_string=f"tags.{SWEEP_TAG} = '{sweep}' and tags.kind = 'cell'", max_results=10000
        )
        for cell in cells:
            client.set_tag(cell.info.run_id, "mlflow.parentRunId", parent.info.run_id)
        mlflow.log_metric("cells", len(cells))
        return parent.info.run_id
