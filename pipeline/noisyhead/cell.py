"""One cell of an experiment: data -> train -> evaluate -> plot, as one MLflow run."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from omegaconf import DictConfig

from pipeline import device, tracking
from pipeline.noisyhead import attacks, config, data, evaluate, plot, train
from pipeline.sweep import progress, short_key, swept_values

log = logging.getLogger(__name__)


def cell_name(cfg: DictConfig, const: config.Constants, sweep: tracking.Sweep | None = None) -> str:
    """What the run is: a sweep's cell is named by its experiment and every swept value
    (``fig4_robustness c=2 p=2.02``); a single run by its regime, N, eps and T."""
    swept = swept_values(sweep)
    if swept:
        prefix = cfg.get("experiment_name") or cfg.regime.name
        return " ".join([prefix, *(f"{short_key(k)}={v}" for k, v in swept.items())])
    T = const.T[0] if len(const.T) == 1 else f"{min(const.T)}..{max(const.T)}"
    return f"{cfg.regime.name} N={const.N} eps={cfg.privacy.eps:g} T={T}"


def headline_keys(cfg: DictConfig, swept) -> list[str]:
    """The runs table's param columns: the keys ``headline_params`` logs for a cell of a sweep that
    varies the keys ``swept``, less a swept key already shown by its short name (``regime.N``: N)."""
    keys = ["N", "eps", "T", "B", *(("attack.c", "attack.p", "alpha") if cfg.attack.name != "none" else ())]
    keys = list(dict.fromkeys([*keys, *(k.lstrip("+~") for k in swept)]))
    return [k for k in keys if not ("." in k and short_key(k) in keys)]


def headline_params(cfg: DictConfig, const: config.Constants, sweep: tracking.Sweep | None) -> dict[str, object]:
    """The short params the runs table shows first (``headline_keys``): N, eps, T, B, alpha under an
    attack, and every swept value under its override key (``attack.c``, ``attack.p``)."""
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


def _g(value: float, spec: str) -> str:
    """``value`` in ``spec``'s width, or ``n/a`` there where it is undefined (NaN: one trial's sd and interval)."""
    if value != value:
        return format("n/a", spec.split(".")[0])  # the alignment and width ('<10') without the precision
    return format(value, spec)


def summary(results) -> str:
    attacked = results["attack_risk_mean"].notna().any()
    head = f"{'method':>15} {'T':>5} {'excess risk (mean +- sd)':>30} {'95% CI of mean':>26} {'test MSE':>10}"
    lines = [head + (f" {'coupling':>12} {'attack risk (mean +- sd)':>28}" if attacked else "")]
    for r in results.itertuples():
        line = (f"{r.method:>15} {r.T:>5} {r.excess_risk_mean:>16.4g} +- {_g(r.excess_risk_sd, '<10.3g')} "
                f"[{_g(r.excess_risk_ci_low, '>10.4g')}, {_g(r.excess_risk_ci_high, '>10.4g')}] {r.test_mse_mean:>10.4g}")
        if attacked:
            line += f" {r.coupling:>12} {r.attack_risk_mean:>14.4g} +- {_g(r.attack_risk_sd, '<10.3g')}"
        lines.append(line)
    return "\n".join(lines)


def method_labels(cfg: DictConfig) -> dict[str, str]:
    """Each method's name in tables and legends (its file's ``label``), and the zero predictor's."""
    return {name: spec.get("label", name) for name, spec in cfg.method.items()} | {evaluate.ZERO: "predicting 0 (reference)"}


def run(cfg: DictConfig, const: config.Constants) -> Path:
    """Run one cell, validated (``const``: ``config.validate``'s constants) and checked
    (``pipeline.preflight``); return the path of its ``results.csv``."""
    if cfg.compute.threads:
        torch.set_num_threads(int(cfg.compute.threads))
    dev = device.of(cfg)  # checked by pipeline.preflight: one the machine has
    device.configure(cfg, dev)
    out = tracking.output_dir()
    job = tracking.begin_cell(cfg, out)
    if job is None:  # a resumed sweep: this folder holds the same cell, finished
        return out / "results.csv"
    tracking.setup(cfg)
    sweep = job.sweep
    tags = job.tags() | {"task": "noisyhead", "regime": cfg.regime.name, "dataset": cfg.dataset.name}
    name = cell_name(cfg, const, sweep)
    params = headline_params(cfg, const, sweep)
    shown = {k: v for k, v in params.items() if not ("." in k and short_key(k) in params)}  # regime.N: N is there
    log.info("cell: %s (%s)", name, " ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                                              for k, v in shown.items()))
    with tracking.run(name, tags) as active:
        start = time.perf_counter()
        tracking.log_headline_params(params)
        tracking.log_params("compute", {"device": str(dev), "device_name": device.name(dev), "tf32": cfg.compute.tf32})
        tracking.log_config(cfg)
        data.release_unless_reused(cfg, const, dev)  # the previous cell's prompts are not this cell's peak
        device.reset_peak(dev)
        problem = data.run(cfg, const, dev)
        fits = train.run(problem, const, cfg)
        attacked = None
        if cfg.attack.name != "none":
            bad = attacks.ATTACKS[cfg.attack.name](problem, const, cfg.attack)
            attacked = train.run_attacked(bad, const, cfg)
        results = evaluate.run(problem, fits, const, cfg, attacked)
        device.synchronize(dev)
        peak = device.peak_memory_gb(dev)
        if peak is not None:
            tracking.log_metrics("compute", {"peak_memory_gb": peak})
        out.mkdir(parents=True, exist_ok=True)
        csv = out / "results.csv"
        results.to_csv(csv, index=False)
        draw = cfg.plot.get("cell_figures")
        draw = sweep is None if draw is None else bool(draw)
        figs = plot.figures(results, cfg.plot, out, labels=method_labels(cfg)) if draw else []
        tracking.log_headline_metrics(headline_metrics(results))
        tracking.set_tag("mlflow.note.content", f"```\n{summary(results)}\n```")  # the run page's Description
        tracking.log_artifacts(csv, *figs)
        seconds = time.perf_counter() - start
        tracking.log_metrics("cell", {"seconds": seconds})
    job.finished(active.info.run_id, {"device": str(dev), "device_name": device.name(dev), "seconds": seconds,
                                      "peak_memory_gb": peak})
    log.info("%s\n%s", name, summary(results))
    log.info("wrote %s%s; MLflow run %s: %s", csv, "".join(f", {f}" for f in figs), active.info.run_id,
             tracking.ui_address(cfg, active.info.run_id))
    line = progress(sweep)
    if line:
        log.info("%s", line)
    return csv
