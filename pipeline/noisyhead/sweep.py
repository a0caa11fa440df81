"""The end of a NoisyHead sweep: its figures (one per measure), its table (``report.table``), its
report and parent MLflow run, and ``metrics.json`` for DVC, from the concatenated ``results.csv``
of the cells that finished (``pipeline.sweep`` collects them and calls ``summarise``)."""

from __future__ import annotations

import logging
from pathlib import Path

import pandas as pd
from omegaconf import DictConfig, OmegaConf

from pipeline import report as reporting
from pipeline import sweep
from pipeline.noisyhead import cell, plot

log = logging.getLogger(__name__)


def metrics(results: pd.DataFrame, config: DictConfig) -> dict:
    """The sweep's ``metrics.json`` (for ``dvc metrics show``): per plotted method, the smallest and
    largest mean of the plotted measure across cells, and the number of cells and trials."""
    metrics = {"cells": int(results[["N", "eps", "attack_c", "attack_p"]].astype(str).drop_duplicates().shape[0]),
               "trials": int(results["B"].iloc[0])}
    for method, rows in plot.shown(results, config.plot).groupby("method"):
        for coupling, sub in rows.groupby(rows["coupling"].fillna("")):
            for y in plot.measures(config.plot):
                if sub[f"{y}_mean"].isna().all():  # a measure the method has not (the zero predictor's attack risk)
                    continue
                key = f"{method}{'_' + coupling if coupling else ''}_{y}_mean"
                metrics[f"{key}_min"] = float(sub[f"{y}_mean"].min())
                metrics[f"{key}_max"] = float(sub[f"{y}_mean"].max())
    return metrics


def summarise(config: DictConfig, sweep_id: str, sweep_dir: Path, cells: sweep.Cells, results: pd.DataFrame,
              csv: Path) -> None:
    """The sweep's figures, table, report and parent run, from the cells that finished."""
    sweep_dir = Path(sweep_dir)
    labels = cell.method_labels(config)
    figs = plot.figures(results, config.plot, sweep_dir, labels=labels)
    artifacts = [str(csv), *map(str, figs)]
    if config.report.table:
        spec = config.report.table
        value = spec.value if isinstance(spec.value, str) else list(spec.value)
        numbers, markdown = plot.table(plot.shown(results, config.plot), list(spec.rows), value, labels=labels)
        numbers.to_csv(sweep_dir / "table.csv", index=False)
        (sweep_dir / "table.md").write_text(markdown)
        artifacts += [str(sweep_dir / "table.csv"), str(sweep_dir / "table.md")]
        log.info("table:\n%s", markdown)
    y = plot.measures(config.plot)[0]
    overrides = [r.get("overrides") or [] for r in cells.done]
    table = reporting.summary_table(plot.shown(results, config.plot), y, labels)
    config_yaml = OmegaConf.to_yaml({k: v for k, v in config.items() if k != "hydra"}, resolve=True)
    name = config.get("experiment_name") or f"sweep {config.regime.name}"
    runs = [(" ".join(o), r["run_id"], r.get("compute") or {}) for o, r in zip(overrides, cells.done)]
    page = reporting.write_html(sweep_dir / "report.html", f"{name}: {len(cells.done)} cells, B = {config.trials}",
                                sweep.command(), config_yaml, table, figs, runs,
                                caption=f"{y.replace('_', ' ')}, mean (sd) across B = {config.trials} trials, one row "
                                        f"per cell in sweep order", swept=reporting.grid(overrides),
                                **sweep.report_links(config, cells))
    artifacts.append(str(page))
    shown = cell.headline_keys(config, [k for k, v in reporting.grid(overrides).items() if len(v) > 1])
    print(f"\n{name}: {y.replace('_', ' ')}, mean (sd) across B = {config.trials} trials\n"
          f"{reporting.text_table(table)}\nreport: {page}", flush=True)
    sweep.parent_run(config, sweep_id, sweep_dir, cells, f"{name} ({len(cells.done)} cells)", artifacts,
                     {"regime": config.regime.name, "B": config.trials, "measure": y}, reporting.headline(results, y),
                     f"{y.replace('_', ' ')}, mean (sd) across B = {config.trials} trials\n\n"
                     + reporting.markdown_table(table),
                     (shown, list(cell.headline_metrics(plot.shown(results, config.plot)))))
    if config.report.dir:  # after the parent run: a report that cannot be written loses nothing else
        sweep.publish(config, artifacts, metrics(results, config))
    log.info("sweep of %d cells: wrote %s, %s and %s", len(cells.done), csv, page, ", ".join(map(str, figs)))
