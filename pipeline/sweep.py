"""The end of a sweep: its cells' results as one table, figure, report and parent MLflow run.

The sweeper (``hydra_plugins/pipeline_sweeper``) knows the sweep's id and its job list; once
the cells have run it calls ``collect`` (the ``cell.json`` records that cells of *this* sweep
wrote, matched to the job list: a folder re-used from an earlier sweep contributes nothing)
and ``summarise`` (concatenate the cells' ``results.csv`` into the sweep folder, draw the
sweep's figure, write the table and ``report.dir``, and log all of it to a parent MLflow run
that the cells are attached to). Another kind of task can plug in its own ``summarise``.
"""

from __future__ import annotations

import json
import logging
import shlex
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import pandas as pd
from omegaconf import DictConfig, OmegaConf

from pipeline import plot, tracking
from pipeline import report as reporting

log = logging.getLogger(__name__)


@dataclass
class Cells:
    """The cells of one sweep: the records of those that finished (job order), the others' overrides."""
    done: list[dict] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)


def collect(sweep_dir: Path, sweep_id: str, jobs: Sequence[Sequence[str]]) -> Cells:
    """Match the job list to the ``cell.json`` records tagged with this sweep's id."""
    found: dict[tuple[str, ...], dict] = {}
    for path in Path(sweep_dir).rglob(tracking.RECORD):
        record = tracking.read_record(path.parent)
        if record and record.get("sweep") == sweep_id and record.get("status") == "FINISHED":
            found[tuple(record.get("overrides") or ())] = record | {"folder": str(path.parent)}
    cells = Cells()
    for job in jobs:
        record = found.get(tuple(job))
        if record is None:
            cells.failed.append(" ".join(job))
        else:
            cells.done.append(record)
    return cells


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


def summarise(config: DictConfig, sweep_id: str, sweep_dir: Path, cells: Cells) -> None:
    """The sweep's table, figure, report and parent run, from the cells that finished."""
    if not cells.done:
        return
    sweep_dir = Path(sweep_dir)
    results = pd.concat([pd.read_csv(Path(r["folder"]) / "results.csv") for r in cells.done], ignore_index=True)
    csv = sweep_dir / "results.csv"
    results.to_csv(csv, index=False)
    if config.get("task", "noisyhead") == "seqrec":  # the next-item task writes its own tables and figures
        from pipeline.seqrec import sweep as seqrec_sweep

        seqrec_sweep.summarise(config, sweep_id, sweep_dir, cells, results, csv)
        return
    from pipeline import cell  # NoisyHead's cell (imported here: a next-item sweep never loads it)

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
    y = plot.measures(config.plot)[0]
    labels = cell.method_labels(config)
    overrides = [r.get("overrides") or [] for r in cells.done]
    table = reporting.summary_table(plot.shown(results, config.plot), y, labels)
    config_yaml = OmegaConf.to_yaml({k: v for k, v in config.items() if k != "hydra"}, resolve=True)
    name = config.get("experiment_name") or f"sweep {config.regime.name}"
    runs = [(" ".join(o), r["run_id"]) for o, r in zip(overrides, cells.done)]
    page = reporting.write_html(sweep_dir / "report.html", f"{name}: {len(cells.done)} cells, B = {config.trials}",
                                command(), config_yaml, table, figs, runs)
    artifacts.append(str(page))
    shown = ["N", "eps", "T", "B"] + (["attack.c", "attack.p", "alpha"] if config.attack.name != "none" else [])
    shown += [k.lstrip("+~") for k, v in reporting.grid(overrides).items() if len(v) > 1 and k.lstrip("+~") not in shown
              and cell.short_key(k) not in shown]
    print(f"\n{name}: {y.replace('_', ' ')}, mean (sd) across B = {config.trials} trials\n"
          f"{reporting.text_table(table)}\nreport: {page}", flush=True)
    parent_run(config, sweep_id, sweep_dir, cells, f"{name} ({len(cells.done)} cells)", artifacts,
               {"regime": config.regime.name, "B": config.trials, "measure": y}, reporting.headline(results, y),
               f"{y.replace('_', ' ')}, mean (sd) across B = {config.trials} trials\n\n" + reporting.markdown_table(table),
               (shown, [k for k in cell.headline_metrics(plot.shown(results, config.plot))]))
    if config.report.dir:  # after the parent run: a report that cannot be written loses nothing else
        report(results, config, artifacts)
    log.info("sweep of %d cells: wrote %s, %s and %s", len(cells.done), csv, page, ", ".join(map(str, figs)))


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
    params = {"cells": len(cells.done), "task": config.get("task", "noisyhead"), "sweep_dir": str(sweep_dir),
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
