"""The end of a sweep, for every task, and what a cell knows of its sweep.

The sweeper (``hydra_plugins/pipeline_sweeper``) knows the sweep's id and its job list; once the
cells have run it calls ``collect`` (the ``cell.json`` records that cells of *this* sweep wrote,
matched to the job list: a folder re-used from an earlier sweep contributes nothing) and
``summarise``, which writes the sweep's ``results.csv`` (the finished cells' rows, in job order)
and hands the rest to the task (``Task.summarise``: ``pipeline/noisyhead/sweep.py``,
``pipeline/seqrec/sweep.py``). The task writes its tables, figures and report with the helpers
here: ``parent_run`` (the parent MLflow run the cells are attached to, and the runs-table view)
and ``publish`` (the files and metrics.json in ``report.dir``, for DVC).

A cell of a sweep: the values it takes of the swept keys (``swept_values``, ``short_key``) and its
progress line (``progress``).
"""

from __future__ import annotations

import json
import logging
import math
import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import Sequence

import pandas as pd
from omegaconf import DictConfig

from pipeline import report as reporting
from pipeline import tasks, tracking
from pipeline.task import Cells

log = logging.getLogger(__name__)


def collect(sweep_dir: Path, sweep_id: str, jobs: Sequence[Sequence[str]]) -> Cells:
    """Match the job list to the ``cell.json`` records tagged with this sweep's id."""
    found: dict[tuple[str, ...], dict] = {}
    for path in Path(sweep_dir).rglob(tracking.RECORD):
        record = tracking.read_record(path.parent)
        if record and record.get("sweep") == sweep_id and record.get("status") == "FINISHED" \
                and tracking.results_intact(path.parent, record):
            found[tuple(record.get("overrides") or ())] = record | {"folder": str(path.parent)}
    cells = Cells()
    for job in jobs:
        record = found.get(tuple(job))
        if record is None:
            cells.failed.append(" ".join(job))
        else:
            cells.done.append(record)
    return cells


def summarise(config: DictConfig, sweep_id: str, sweep_dir: Path, cells: Cells) -> None:
    """The sweep's ``results.csv`` (every finished cell's rows, in job order), then the task's
    tables, figures, report and parent run (``Task.summarise``)."""
    if not cells.done:
        return
    sweep_dir = Path(sweep_dir)
    frames = [pd.read_csv(Path(r["folder"]) / "results.csv") for r in cells.done]
    cells.sizes = [len(f) for f in frames]
    results = pd.concat(frames, ignore_index=True)
    csv = sweep_dir / "results.csv"
    results.to_csv(csv, index=False)
    tasks.get(config).summarise(config, sweep_id, sweep_dir, cells, results, csv)


def publish(config: DictConfig, artifacts: Sequence[str | Path], metrics: dict) -> None:
    """Copy the sweep's files to ``report.dir`` (if set) under their names, with ``metrics.json``
    (``metrics``, for ``dvc metrics show``): the DVC stages' outputs. A report is copied without its
    run ids and timings (``report.stable``), so that rebuilding an unchanged stage changes no byte."""
    if not config.report.dir:
        return
    out = Path(config.report.dir)
    out.mkdir(parents=True, exist_ok=True)
    for path in artifacts:
        if Path(path).suffix == ".html":  # the report without run ids and timings: reproducible bytes
            (out / Path(path).name).write_text(reporting.stable(Path(path).read_text(encoding="utf-8")), encoding="utf-8")
        else:
            shutil.copyfile(path, out / Path(path).name)
    finite = {k: v for k, v in metrics.items() if not (isinstance(v, float) and not math.isfinite(v))}  # JSON has no NaN
    if dropped := sorted(set(metrics) - set(finite)):
        log.warning("metrics.json leaves out %d value(s) that are not finite: %s", len(dropped), ", ".join(dropped))
    (out / "metrics.json").write_text(json.dumps(finite, indent=2, sort_keys=True, allow_nan=False) + "\n")


def short_key(key: str) -> str:
    """``attack.c`` -> ``c``, ``privacy.eps`` -> ``eps``, ``+x.y`` -> ``y``: the last part of an override key."""
    return key.lstrip("+~").rsplit(".", 1)[-1]


def swept_values(sweep: tracking.Sweep | None) -> dict[str, str]:
    """The values this cell takes of the keys its sweep varies: {key: value}, in override order."""
    if sweep is None:
        return {}
    pairs = (o.partition("=") for o in sweep.overrides)
    return {key: value for key, _, value in pairs if key in sweep.swept}


def progress(sweep: tracking.Sweep | None) -> str | None:
    """``sweep k/n cells done, <elapsed> elapsed, about <left> left`` for a cell of a sweep (k counts
    this sweep's finished cells, whichever worker ran them)."""
    if sweep is None or not sweep.cells:
        return None
    done = sum(1 for p in Path(sweep.dir).rglob(tracking.RECORD)
               if (tracking.read_record(p.parent) or {}).get("sweep") == sweep.id)
    elapsed = max(time.time() - sweep.started, 0.0) if sweep.started else 0.0
    left = elapsed / done * (sweep.cells - done) if done and elapsed else float("nan")
    eta = f", about {_duration(left)} left" if left == left and done < sweep.cells else ""
    return f"sweep {done}/{sweep.cells} cells done, {_duration(elapsed)} elapsed{eta}"


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


def report_links(config: DictConfig, cells: Cells) -> dict:
    """``report.write_html``'s ``links`` (the finished cells' run pages in the MLflow UI, for the
    cells table) and ``links_note`` (where they open: a local store's need ``mlflow ui`` started on it)."""
    links = tracking.run_links(config, [r["run_id"] for r in cells.done])
    note = None if tracking.ui_served(config) else (
        f"Each run id links to its run in the MLflow UI at {config.mlflow.ui}, once it serves this store: "
        f"mlflow ui --backend-store-uri {tracking.mlflow.get_tracking_uri()}")
    return {"links": links, "links_note": note}


def command() -> str:
    """The command line that started this process."""
    return "python -m pipeline " + " ".join(shlex.quote(a) for a in sys.argv[1:])


def parent_run(config: DictConfig, sweep_id: str, sweep_dir: Path, cells: Cells, name: str, artifacts: list[str],
               params: dict, metrics: dict | None = None, description: str | None = None,
               columns: tuple[list[str], list[str]] = ([], [])) -> str:
    """The sweep's parent run (either task): its artifacts, the cells that finished attached, the
    grid and command as params, the failed cells named; and a runs-table view of the sweep whose
    columns are ``columns`` (params, metrics): ``tracking.share_view``. Prints where both are
    shown; returns the parent's run id."""
    tracking.setup(config)
    grid = reporting.grid([r.get("overrides") or [] for r in cells.done])
    params = {"cells": len(cells.done), "task": tasks.name(config), "sweep_dir": str(sweep_dir),
              **params,
              "grid": "; ".join(f"{k}={','.join(v)}" for k, v in grid.items() if len(v) > 1)[:6000] or "-",
              "command": command()[:6000]}
    tags = {tracking.SWEEP_DIR_TAG: str(Path(sweep_dir).resolve())}
    if cells.failed:
        params["failed_cells"] = "; ".join(cells.failed)[:6000]
        tags["failed_cells"] = str(len(cells.failed))
    parent = tracking.finish_sweep(sweep_id, name, artifacts, params, [r["run_id"] for r in cells.done], tags,
                                   metrics, description)
    experiment = tracking.share_view(parent, sweep_id, *columns)
    print(f"MLflow parent run {parent}: {tracking.ui_address(config, parent)}\n"
          f"the sweep's runs table: {tracking.view_address(config, experiment, sweep_id)}", flush=True)
    return parent
