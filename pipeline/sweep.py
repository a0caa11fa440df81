"""Hydra callback that turns the cells of a multirun into one result.

At the start of a sweep it names the sweep (cells tag their MLflow runs with it);
at the end it concatenates the cells' ``results.csv`` into the sweep folder, draws
the sweep's figure there, and logs both to a parent MLflow run that the cells are
attached to.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import pandas as pd
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from pipeline import cell, plot, tracking

log = logging.getLogger(__name__)


def report(results: pd.DataFrame, config: DictConfig, artifacts: list[str]) -> None:
    """Copy the sweep's files to ``report.dir`` under stable names, with a small metrics.json
    (for ``dvc metrics show``): per plotted method, the smallest and largest mean of the
    plotted measure across cells, and the number of cells and trials."""
    out = Path(config.report.dir)
    out.mkdir(parents=True, exist_ok=True)
    for path in artifacts:
        shutil.copyfile(path, out / Path(path).name)
    metrics = {"cells": int(results[["N", "eps", "attack_c", "attack_p"]].astype(str).drop_duplicates().shape[0]),
               "trials": int(results["B"].iloc[0])}
    for method, rows in plot.shown(results, config.plot).groupby("method"):
        for coupling, sub in rows.groupby(rows["coupling"].fillna("")):
            for y in plot.measures(config.plot):
                key = f"{method}{'_' + coupling if coupling else ''}_{y}_mean"
                metrics[f"{key}_min"] = float(sub[f"{y}_mean"].min())
                metrics[f"{key}_max"] = float(sub[f"{y}_mean"].max())
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")


class SweepCallback(Callback):
    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        os.environ[tracking.SWEEP_ENV] = f"{Path(config.hydra.sweep.dir).name}-{uuid.uuid4().hex[:6]}"

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep = os.environ.pop(tracking.SWEEP_ENV, None)
        sweep_dir = Path(config.hydra.sweep.dir)
        frames = [pd.read_csv(p) for p in sorted(sweep_dir.glob("*/results.csv"))]
        if not frames or sweep is None:
            return
        results = pd.concat(frames, ignore_index=True)
        csv = sweep_dir / "results.csv"
        results.to_csv(csv, index=False)
        if config.get("task", "noisyhead") == "seqrec":
            from pipeline.seqrec.cell import sweep_artifacts

            tracking.setup(config)
            tracking.finish_sweep(sweep, config.get("experiment_name") or "sweep seqrec",
                                  [str(csv), *sweep_artifacts(results, sweep_dir)],
                                  params={"cells": len(frames), "task": "seqrec", "sweep_dir": str(sweep_dir)})
            return
        figs = plot.figures(results, config.plot, sweep_dir, labels=cell.method_labels(config))
        artifacts = [str(csv), *map(str, figs)]
        if config.report.table:
            spec = config.report.table
            value = spec.value if isinstance(spec.value, str) else list(spec.value)
            numbers, markdown = plot.table(plot.shown(results, config.plot), list(spec.rows), value,
                                           labels=cell.method_labels(config))
            numbers.to_csv(sweep_dir / "table.csv", index=False)
            (sweep_dir / "table.md").write_text(markdown)
            artifacts += [str(sweep_dir / "table.csv"), str(sweep_dir / "table.md")]
            log.info("table:\n%s", markdown)
        if config.report.dir:
            report(results, config, artifacts)
        tracking.setup(config)
        name = config.get("experiment_name") or f"sweep {config.regime.name}"
        tracking.finish_sweep(
            sweep, name, artifacts,
            params={"cells": len(frames), "regime": config.regime.name, "sweep_dir": str(sweep_dir)},
        )
        log.info("sweep of %d cells: wrote %s and %s", len(frames), csv, ", ".join(map(str, figs)))
