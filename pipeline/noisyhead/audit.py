"""NoisyHead's empirical privacy audit: ``python -m pipeline.audit [overrides]`` (the default task).

For each private mechanism (``audit.methods``, default every private one configured), the audit

1. builds a worst-case pair of neighbouring prompt sets (``canary``): N - 1 prompts whose private
   features are zero, shared by both, and one canary prompt, Z~ = G e1 e1^T with response C in
   the first set and -Z~ with response C in the second. Each mechanism's output moves by (close to)
   its sensitivity between the two: exactly so for SSP (the pair of ``privacy.ssp_sensitivity``),
   to leading order for output-perturbed ridge, and by 2 C G per step for NoisyHead;
2. runs the mechanism's own ``fit`` ``audit.runs`` times on each set, with independent noise;
3. projects every output on the difference of the two sets' mean outputs (the likelihood-ratio
   statistic of a Gaussian mechanism), and hands the two samples to ``pipeline.audit.bounds``: a
   threshold chosen on a first ``audit.select_fraction`` of the runs, a Clopper-Pearson lower bound
   on eps from the rest, and the verdict (violation, consistent, inconclusive).

Every mechanism gets its own MLflow run (tag kind=audit) with its parameters,
the bound, the counts and a histogram of the statistic; ``audit.csv`` in the Hydra run folder
holds one row per mechanism.
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from omegaconf import DictConfig, OmegaConf

from pipeline import plot, progress, tracking
from pipeline.audit import bounds
from pipeline.noisyhead import config
from pipeline.noisyhead.data import Problem
from pipeline.noisyhead.features import Features
from pipeline.noisyhead.methods import ESTIMATORS
from pipeline.validation import ConfigError

log = logging.getLogger(__name__)


def canary(const: config.Constants, runs: int, dtype: torch.dtype, *, neighbour: bool) -> Problem:
    """The audit's prompt set, repeated for ``runs`` runs (stride-0 views, no copies): N - 1 zero
    features with zero responses and, in prompt 0, Z~ = G e1 e1^T (neighbour: -Z~) with response C."""
    N, D = const.N, const.D
    q = torch.zeros(N, D, dtype=dtype)
    v = torch.zeros(N, D, dtype=dtype)
    y = torch.zeros(N, dtype=dtype)
    q[0, 0] = 1.0
    v[0, 0] = -const.G if neighbour else const.G
    y[0] = const.C
    feats = Features(q.expand(runs, N, D), v.expand(runs, N, D), y.expand(runs, N))
    return Problem(train=feats, private=feats, test=feats, clip_fraction=0.0, projected_fraction=0.0,
                   fingerprint="canary-" + ("neighbour" if neighbour else "first"))


def audited(cfg: DictConfig) -> list[str]:
    """The method names to audit: ``audit.methods``, or every private one configured."""
    names = list(cfg.audit.methods) if cfg.audit.methods else [
        name for name, spec in cfg.method.items() if ESTIMATORS[spec.estimator].PRIVATE]
    for name in names:
        if name not in cfg.method:
            raise ConfigError(f"audit.methods: {name!r} is not a configured method; configured: {list(cfg.method)}")
        if not ESTIMATORS[cfg.method[name].estimator].PRIVATE:
            raise ConfigError(f"audit.methods: {name!r} is not a private mechanism")
    return names


def validate(cfg: DictConfig) -> tuple[config.Constants, list[str]]:
    const = config.validate(cfg)
    bounds.check_keys(cfg.audit)
    return const, audited(cfg)


def runs_of(name: str, cfg: DictConfig) -> int:
    return int((cfg.audit.runs_for or {}).get(name, cfg.audit.runs))


def outputs(name: str, const: config.Constants, cfg: DictConfig) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The mechanism's outputs on the two sets, flattened (runs, D^2) (its first horizon), and its
    logged parameters."""
    spec = OmegaConf.create(OmegaConf.to_container(cfg.method[name]) | {"noise_scale": float(cfg.audit.noise_scale)})
    method = ESTIMATORS[spec.estimator]
    dtype = getattr(torch, cfg.compute.dtype)
    runs = runs_of(name, cfg)
    fits = []
    for nb, side in ((False, "canary"), (True, "neighbour")):
        log.info("audit: %s, %d runs on the %s set (%d/2)", name, runs, side, len(fits) + 1)
        fits.append(method.fit(canary(const, runs, dtype, neighbour=nb), const, cfg, spec, stream=f":audit-{side}"))
    return fits[0].gamma[:, 0].flatten(1), fits[1].gamma[:, 0].flatten(1), fits[0].params


def statistic(first: torch.Tensor, second: torch.Tensor, n_sel: int) -> tuple[np.ndarray, np.ndarray]:
    """<output, u> with u the difference of the two sets' mean outputs over the selection runs."""
    u = first[:n_sel].mean(0) - second[:n_sel].mean(0)
    return (first @ u).numpy(), (second @ u).numpy()


def audit_one(name: str, const: config.Constants, cfg: DictConfig, out: Path) -> dict:
    a = cfg.audit
    eps, delta = float(cfg.privacy.eps), float(cfg.privacy.delta)
    with tracking.run(f"audit {name} eps={eps:g}", {"kind": "audit", "method": name, "regime": cfg.regime.name}):
        first, second, params = outputs(name, const, cfg)
        runs = runs_of(name, cfg)
        n_sel = int(round(a.select_fraction * runs))
        s_first, s_second = statistic(first, second, n_sel)
        bound = bounds.eps_lower_bound(s_first, s_second, delta=delta, confidence=float(a.confidence),
                                select_fraction=float(a.select_fraction))
        power = bounds.eps_power(bound.held_out, float(a.power_factor) * eps, delta=delta, confidence=float(a.confidence))
        outcome = bounds.verdict(bound, eps, power)
        row = {"method": name, "eps": eps, "delta": delta, "runs": runs, "noise_scale": float(a.noise_scale),
               "N": const.N, "D": const.D, **asdict(bound), "eps_power": power, "verdict": outcome}
        tracking.log_params("audit", {k: v for k, v in row.items() if k not in ("eps_lower", "eps_estimate", "eps_ceiling", "eps_power", "tpr", "fpr")}
                            | {"confidence": a.confidence, "select_fraction": a.select_fraction})
        tracking.log_params("train", const.as_params())
        tracking.log_params(f"train.{name}", params)
        tracking.log_metrics("audit", {"eps_lower": bound.eps_lower, "eps_estimate": min(bound.eps_estimate, 1e6),
                                       "tpr": bound.tpr, "fpr": bound.fpr, "claimed_eps": eps,
                                       "eps_ceiling": bound.eps_ceiling, "eps_power": power})
        tracking.set_tag("verdict", outcome)
        held = slice(n_sel, None)
        fig = plot.audit_histogram(s_first[held], s_second[held], bound, row, out / f"audit_{name}.png")
        tracking.log_artifacts(fig)
    log.info("audit %s: eps >= %.3g at %.0f%% confidence (claimed %g): %s", name, bound.eps_lower,
             100 * a.confidence, eps, outcome.upper())
    return row


def run(cfg: DictConfig) -> pd.DataFrame:
    const, names = validate(cfg)  # before anything is created or computed
    if cfg.compute.threads:
        torch.set_num_threads(int(cfg.compute.threads))
    out = tracking.output_dir()
    out.mkdir(parents=True, exist_ok=True)
    tracking.setup(cfg)
    rows = [audit_one(name, const, cfg, out) for name in progress.steps("audit", names, unit="mechanism")]
    table = pd.DataFrame(rows)
    table.to_csv(out / "audit.csv", index=False)
    shown = table[["method", "eps", "delta", "noise_scale", "runs", "eps_lower", "eps_ceiling", "eps_power", "tpr", "fpr", "verdict"]]
    log.info("audit at %.0f%% confidence:\n%s\nwrote %s", 100 * cfg.audit.confidence,
             shown.to_string(index=False, float_format=lambda x: f"{x:.4g}"), out / "audit.csv")
    return table
