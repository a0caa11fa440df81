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


def short_key(key: str) -> str:
    """``attack.c`` -> ``c``, ``privacy.eps`` -> ``eps``, ``+x.y`` -> ``y``: the last part of an override key."""
    return key.lstrip("+~").rsplit(".", 1)[-1]


def swept_values(sweep: tracking.Sweep | None) -> dict[str, str]:
    """The values this cell takes of the keys its sweep varies: {key: value}, in override order."""
    if sweep is None:
        return {}
    pairs = (o.partition("=") for o in sweep.overrides)
    return {key: value for key, _, value in pairs if key in sweep.swept}


def cell_name(cfg: DictConfig, const: config.Constants, sweep: tracking.Sweep | None = None) -> str:
    """What the run is: a sweep's cell is named by its experiment and every swept value
    (``fig4_robustness c=2 p=2.02``); a single run by its regime, N, eps and T."""
    swept = swept_values(sweep)
    if swept:
        prefix = cfg.get("experiment_name") or cfg.regime.name
        return " ".join([prefix, *(f"{short_key(k)}={v}" for k, v in swept.items())])
    T = const.T[0] if len(const.T) == 1 else f"{min(const.T)}..{max(const.T)}"
    return f"{cfg.regime.name} N={const.N} eps={cfg.privacy.eps:g} T={T}"


def headline_params(cfg: DictConfig, const: config.Constants, sweep: tracking.Sweep | None) -> dict[str, object]:
    """The short params the runs table shows first: N, eps, T, B, alpha under an attack, and every swept
    value under its override key (``attack.c``, ``attack.p``)."""
    T = str(const.T[0]) if len(const.T) == 1 else f"{min(const.T)}..{max(const.T)} ({len(const.T)} horizons)"
    params: dict[str, object] = {"N": const.N, "eps": cfg.privacy.eps, "T": T, "B": cfg.trials}
    if cfg.attack.name != "none":
        params |= {"attack.c": cfg.attack.c, "attack.p": cfg.attack.p, "alpha": attacks.alpha(cfg.attack, const.N)}
    params |= {k.lstrip("+~"): v[:500] for k, v in swept_values(sweep).items()}
    return params


def headline_metrics(results) -> dict[str, float]:
    """Per method (and coupling), the mean excess risk and attack risk at the last horizon:
    ``excess_risk.<method>``, ``attack_risk.<method>.<coupling>``."""
    out = {}
    last = results[results["T"] == results.groupby("method")["T"].transform("max")]
    for r in last.itertuples():
        out[f"excess_risk.{r.method}"] = float(r.excess_risk_mean)
        if r.attack_risk_mean == r.attack_risk_mean:  # not NaN
            out[f"attack_risk.{r.method}" + (f".{r.coupling}" if r.coupling not in ("", "none") else "")] = float(r.attack_risk_mean)
    return out


def progress(sweep: tracking.Sweep | None, folder: Path) -> str | None:
    """``cell k/n done, <elapsed> elapsed, about <left> left`` for a cell of a sweep (k counts this
    sweep's finished cells, whichever worker ran them)."""
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
    sweep = job.sweep
    tags = job.tags() | {"task": "noisyhead", "regime": cfg.regime.name, "dataset": cfg.dataset.name}
    name = cell_name(cfg, const, sweep)
    shown = headline_params(cfg, const, sweep)
    shown = {k: v for k, v in shown.items() if not ("." in k and short_key(k) in shown)}  # regime.N: N is there
    log.info("cell: %s (%s)", name, " ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                                              for k, v in shown.items()))
    with tracking.run(name, tags) as active:
        start = time.perf_counter()
        mlflow.log_params(headline_params(cfg, const, sweep))
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
        draw = cfg.plot.get("cell_figures")
        draw = sweep is None if draw is None else bool(draw)
        figs = plot.figures(results, cfg.plot, out, labels=method_labels(cfg)) if draw else []
        mlflow.log_metrics(headline_metrics(results))
        mlflow.set_tag("mlflow.note.content", f"```\n{summary(results)}\n```")  # the run page's Description
        mlflow.log_artifact(str(csv))
        for fig in figs:
            mlflow.log_artifact(str(fig))
        tracking.log_metrics("cell", {"seconds": time.perf_counter() - start})
    job.finished(active.info.run_id)
    log.info("%s\n%s", name, summary(results))
    log.info("wrote %s%s", csv, "".join(f", {f}" for f in figs))
    line = progress(sweep, out)
    if line:
        log.info("%s", line)
    return csv
