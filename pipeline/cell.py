"""One cell of an experiment: data -> train -> evaluate -> plot, as one MLflow run."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import mlflow
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from pipeline import attacks, config, data, evaluate, plot, preflight, tracking, train

log = logging.getLogger(__name__)


def output_dir() -> Path:
    try:
        return Path(HydraConfig.get().runtime.output_dir)
    except ValueError:  # called outside a Hydra app (tests, notebooks)
        return Path.cwd()


def cell_name(cfg: DictConfig, const: config.Constants) -> str:
    T = const.T[0] if len(const.T) == 1 else f"{min(const.T)}..{max(const.T)}"
    return f"{cfg.regime.name} N={const.N} eps={cfg.privacy.eps:g} T={T}"


def summary(results) -> str:
    attacked = results["attack_risk_mean"].notna().any()
    head = f"{'method':>15} {'T':>5} {'excess risk (mean +- sd)':>30} {'95% CI of mean':>26} {'test MSE':>10}"
    lines = [head + (f" {'coupling':>12} {'attack risk (mean +- sd)':>28}" if attacked else "")]
    for r in results.itertuples():
        line = (f"{r.method:>15} {r.T:>5} {r.excess_risk_mean:>16.4g} +- {r.excess_risk_sd:<10.3g} "
                f"[{r.excess_risk_ci_low:>10.4g}, {r.excess_risk_ci_high:>10.4g}] {r.test_mse_mean:>10.4g}")
        if attacked:
            line += f" {r.coupling:>12} {r.attack_risk_mean:>14.4g} +- {r.attack_risk_sd:<10.3g}"
        lines.append(line)
    return "\n".join(lines)


def method_labels(cfg: DictConfig) -> dict[str, str]:
    return {name: spec.get("label", name) for name, spec in cfg.method.items()}


def run(cfg: DictConfig) -> Path:
    """Run one cell; return the path of its ``results.csv``."""
    const = config.validate(cfg)  # before anything is created or computed
    preflight.check(cfg, const)  # the output folder, the MLflow store, the memory the cell needs
    if cfg.compute.threads:
        torch.set_num_threads(int(cfg.compute.threads))
    out = output_dir()
    job = tracking.begin_cell(cfg, out)
    if job is None:  # a resumed sweep: this folder holds the same cell, finished
        return out / "results.csv"
    tracking.setup(cfg)
    tags = job.tags() | {"task": "noisyhead", "regime": cfg.regime.name, "dataset": cfg.dataset.name}
    name = cell_name(cfg, const)
    with tracking.run(name, tags) as active:
        start = time.perf_counter()
        mlflow.log_text(OmegaConf.to_yaml(cfg, resolve=True), "config.yaml")
        problem = data.run(cfg, const)
        fits = train.run(problem, const, cfg)
        attacked = None
        if cfg.attack.name != "none":
            bad = attacks.ATTACKS[cfg.attack.name](problem, const, cfg.attack)
            attacked = train.run_attacked(bad, const, cfg)
        results = evaluate.run(problem, fits, const, cfg, attacked)
        out.mkdir(parents=True, exist_ok=True)
        csv = out / "results.csv"
        results.to_csv(csv, index=False)
        figs = plot.figures(results, cfg.plot, out, labels=method_labels(cfg))
        mlflow.log_artifact(str(csv))
        for fig in figs:
            mlflow.log_artifact(str(fig))
        tracking.log_metrics("cell", {"seconds": time.perf_counter() - start})
    job.finished(active.info.run_id)
    log.info("%s\n%s", name, summary(results))
    log.info("wrote %s and %s", csv, ", ".join(str(f) for f in figs))
    return csv
