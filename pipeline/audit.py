"""Empirical privacy audit: ``python -m pipeline.audit [overrides]``.

(A config with ``task: seqrec``, e.g. ``experiment=dpformer_ci``, audits one DP-SGD step of the
next-item task instead, with a canary user: ``pipeline/seqrec/audit.py``, reusing the bound below.)

For each private mechanism (``audit.methods``, default every private one configured), the audit

1. builds a worst-case pair of neighbouring prompt sets (``canary``): N - 1 prompts whose private
   features are zero, shared by both, and one canary prompt, Z~ = G e1 e1^T with response C in
   the first set and -Z~ with response C in the second. Each mechanism's output moves by (close to)
   its sensitivity between the two: exactly so for SSP (the pair of ``privacy.ssp_sensitivity``),
   to leading order for output-perturbed ridge, and by 2 C G per step for NoisyHead;
2. runs the mechanism's own ``fit`` ``audit.runs`` times on each set, with independent noise;
3. projects every output on the difference of the two sets' mean outputs (the likelihood-ratio
   statistic of a Gaussian mechanism), on a first ``audit.select_fraction`` of the runs, and there
   picks the rejection region {s > t} or {s < t}, and which set plays "in", that maximise the
   Clopper-Pearson lower bound on eps below;
4. on the remaining, untouched runs, counts how often each set lands in that region and reports
   eps_lower = log((TPR_low - delta) / FPR_high), where TPR_low and FPR_high are one-sided
   Clopper-Pearson bounds at level 1 - (1 - confidence) / 2 each, so eps_lower is a lower
   bound on the mechanism's eps at ``audit.confidence``: any (eps, delta)-DP mechanism has
   P[M(D) in S] <= e^eps P[M(D') in S] + delta for every S.

The verdict is ``violation`` when eps_lower exceeds the claimed ``privacy.eps``: a proof, whatever
the run count. Otherwise it is ``consistent`` only if the audit had the power to show a violation,
and ``inconclusive (too few runs: ...)`` where it had not. Two numbers decide, both from the
held-out run count n alone:

- ``eps_ceiling``: the largest bound n runs can ever give, that of perfect separation (every "in"
  run in the region, none of the others);
- ``eps_power``: the bound the audit would reach (at expected counts) against a Gaussian mechanism,
  the shape of every audited mechanism's noise, whose true eps is ``audit.power_factor`` times the
  claim. Where even that clear a violation would not be shown (eps_power <= claimed eps), a quiet
  audit says nothing. With the defaults and a claim of 1: 2,000 runs give eps_ceiling 6.2 but
  eps_power 0.62 (inconclusive); 100,000 runs give 10.1 and 1.27 (a 2x violation would be caught).

Every mechanism gets its own MLflow run (tag kind=audit) with its parameters,
the bound, the counts and a histogram of the statistic; ``audit.csv`` in the Hydra run folder
holds one row per mechanism.
"""

from __future__ import annotations

import logging
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import hydra
import mlflow
import numpy as np
import pandas as pd
import torch
from omegaconf import DictConfig, OmegaConf
from scipy.stats import beta, norm

from pipeline import cell, config, plot, privacy, tracking
from pipeline.config import ConfigError
from pipeline.data import Problem
from pipeline.features import Features
from pipeline.methods import ESTIMATORS

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Bound:
    eps_lower: float  # the lower bound on eps at the audit's confidence
    eps_estimate: float  # log((TPR - delta) / FPR) from the held-out counts (no confidence margin)
    threshold: float
    region: str  # "above" ({s > t}) or "below" ({s < t})
    positive: str  # which set plays "in": "canary" (the first set) or "neighbour"
    tpr: float  # held-out share of the "in" set's runs in the region
    fpr: float  # held-out share of the other set's runs in the region
    held_out: int  # runs per set the counts come from
    eps_ceiling: float  # the largest bound these held-out runs could give (perfect separation)


def clopper_pearson(k: np.ndarray, n: int, level: float) -> tuple[np.ndarray, np.ndarray]:
    """One-sided Clopper-Pearson bounds on a binomial proportion from k successes in n trials:
    (lower, upper), each holding with probability at least ``level``."""
    k = np.asarray(k, dtype=np.float64)
    lower = np.where(k > 0, beta.ppf(1 - level, np.maximum(k, 1), n - k + 1), 0.0)
    upper = np.where(k < n, beta.ppf(level, k + 1, np.maximum(n - k, 1)), 1.0)
    return lower, upper


def _log_ratio(tpr_low: np.ndarray, fpr_high: np.ndarray, delta: float) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.log((tpr_low - delta) / fpr_high)
    return np.where(tpr_low > delta, np.nan_to_num(out, nan=0.0, neginf=0.0), 0.0)


def _regions(s_in: np.ndarray, s_out: np.ndarray, thresholds: np.ndarray):
    """Counts of each sample in {s > t} and {s < t} for every t, both role assignments:
    yields (region, positive, counts of the 'in' sample, counts of the 'out' sample)."""
    a, b = np.sort(s_in), np.sort(s_out)
    a_above = a.size - np.searchsorted(a, thresholds, side="right")
    b_above = b.size - np.searchsorted(b, thresholds, side="right")
    a_below = np.searchsorted(a, thresholds, side="left")
    b_below = np.searchsorted(b, thresholds, side="left")
    yield "above", "canary", a_above, b_above
    yield "below", "canary", a_below, b_below
    yield "above", "neighbour", b_above, a_above
    yield "below", "neighbour", b_below, a_below


def eps_ceiling(n: int, *, delta: float, confidence: float = 0.95) -> float:
    """The largest lower bound an audit with ``n`` held-out runs per set can report: the bound of
    perfect separation, TPR_low = (1 - level)^(1/n) and FPR_high = 1 - (1 - level)^(1/n)."""
    level = 1 - (1 - confidence) / 2
    lo, _ = clopper_pearson(np.array([n]), n, level)
    _, hi = clopper_pearson(np.array([0]), n, level)
    return max(0.0, float(_log_ratio(lo, hi, delta)[0]))


def eps_power(n: int, eps_alt: float, *, delta: float, confidence: float = 0.95, grid: int = 4000) -> float:
    """The bound an audit with ``n`` held-out runs per set reaches, at expected counts and its best
    threshold, against the Gaussian mechanism that is exactly (eps_alt, delta)-DP (unit noise, shift
    mu = 1 / its noise multiplier): how large a violation the audit can show at all."""
    mu = 1.0 / privacy.gaussian_multiplier(eps=eps_alt, delta=delta)
    level = 1 - (1 - confidence) / 2
    t = np.linspace(-4.0, mu + 9.0, grid)
    lo, _ = clopper_pearson(np.round(n * norm.sf(t - mu)), n, level)
    _, hi = clopper_pearson(np.round(n * norm.sf(t)), n, level)
    return max(0.0, float(_log_ratio(lo, hi, delta).max()))


def verdict(bound: Bound, claimed_eps: float, power: float) -> str:
    """``violation`` (a proof), ``consistent`` (no violation found, and the audit could have found
    one: ``power`` > claimed eps), or ``inconclusive (...)``."""
    if bound.eps_lower > claimed_eps:
        return "violation"
    if power <= claimed_eps or bound.eps_ceiling <= claimed_eps:
        return f"inconclusive (too few runs: at most {bound.eps_ceiling:.3g} provable, {power:.3g} for a clear violation)"
    return "consistent"


def eps_lower_bound(s_canary: np.ndarray, s_neighbour: np.ndarray, *, delta: float, confidence: float = 0.95,
                    select_fraction: float = 0.1, candidates: int = 2000) -> Bound:
    """The lower bound on eps from two samples of a scalar statistic (one per neighbouring set).

    The first ``select_fraction`` of each sample chooses the region; the rest bounds it (the
    choice never sees the counts it is judged by, so the Clopper-Pearson bounds stay valid)."""
    level = 1 - (1 - confidence) / 2  # two one-sided bounds, joint coverage >= confidence
    n_sel = int(round(select_fraction * min(s_canary.size, s_neighbour.size)))
    sel_a, sel_b = s_canary[:n_sel], s_neighbour[:n_sel]
    hold_a, hold_b = s_canary[n_sel:], s_neighbour[n_sel:]
    pooled = np.concatenate([sel_a, sel_b])
    thresholds = np.unique(np.quantile(pooled, np.linspace(0, 1, candidates)))
    best = None
    for region, positive, k_in, k_out in _regions(sel_a, sel_b, thresholds):
        lo, _ = clopper_pearson(k_in, n_sel, level)
        _, hi = clopper_pearson(k_out, n_sel, level)
        value = _log_ratio(lo, hi, delta)
        i = int(np.argmax(value))
        if best is None or value[i] > best[0]:
            best = (value[i], thresholds[i], region, positive)
    _, t, region, positive = best
    n = min(hold_a.size, hold_b.size)
    hold_a, hold_b = hold_a[:n], hold_b[:n]
    counts = {(r, p): (k_in[0], k_out[0]) for r, p, k_in, k_out in _regions(hold_a, hold_b, np.array([t]))}
    k_in, k_out = counts[(region, positive)]
    lo, _ = clopper_pearson(np.array([k_in]), n, level)
    _, hi = clopper_pearson(np.array([k_out]), n, level)
    tpr, fpr = k_in / n, k_out / n
    estimate = math.log((tpr - delta) / fpr) if tpr > delta and fpr > 0 else (math.inf if tpr > delta else 0.0)
    return Bound(eps_lower=max(0.0, float(_log_ratio(lo, hi, delta)[0])), eps_estimate=estimate,
                 threshold=float(t), region=region, positive=positive, tpr=tpr, fpr=fpr, held_out=n,
                 eps_ceiling=eps_ceiling(n, delta=delta, confidence=confidence))


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
    check_keys(cfg.audit)
    return const, audited(cfg)


def check_keys(a: DictConfig) -> None:
    """The audit's own keys (both tasks)."""
    config._positive_int(a.runs, "audit.runs")
    for name, runs in (a.runs_for or {}).items():
        config._positive_int(runs, f"audit.runs_for.{name}")
    if not 0 < a.select_fraction < 1:
        raise ConfigError(f"audit.select_fraction must lie in (0, 1), got {a.select_fraction!r}")
    if not 0 < a.confidence < 1:
        raise ConfigError(f"audit.confidence must lie in (0, 1), got {a.confidence!r}")
    if isinstance(a.power_factor, bool) or not isinstance(a.power_factor, (int, float)) or not a.power_factor > 1:
        raise ConfigError(f"audit.power_factor must be a number > 1, got {a.power_factor!r}")
    if isinstance(a.noise_scale, bool) or not isinstance(a.noise_scale, (int, float)) or not a.noise_scale > 0:
        raise ConfigError(f"audit.noise_scale must be a positive number, got {a.noise_scale!r}")


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
        bound = eps_lower_bound(s_first, s_second, delta=delta, confidence=float(a.confidence),
                                select_fraction=float(a.select_fraction))
        power = eps_power(bound.held_out, float(a.power_factor) * eps, delta=delta, confidence=float(a.confidence))
        outcome = verdict(bound, eps, power)
        row = {"method": name, "eps": eps, "delta": delta, "runs": runs, "noise_scale": float(a.noise_scale),
               "N": const.N, "D": const.D, **asdict(bound), "eps_power": power, "verdict": outcome}
        tracking.log_params("audit", {k: v for k, v in row.items() if k not in ("eps_lower", "eps_estimate", "eps_ceiling", "eps_power", "tpr", "fpr")}
                            | {"confidence": a.confidence, "select_fraction": a.select_fraction})
        tracking.log_params("train", const.as_params())
        tracking.log_params(f"train.{name}", params)
        tracking.log_metrics("audit", {"eps_lower": bound.eps_lower, "eps_estimate": min(bound.eps_estimate, 1e6),
                                       "tpr": bound.tpr, "fpr": bound.fpr, "claimed_eps": eps,
                                       "eps_ceiling": bound.eps_ceiling, "eps_power": power})
        mlflow.set_tag("verdict", outcome)
        held = slice(n_sel, None)
        fig = plot.audit_histogram(s_first[held], s_second[held], bound, row, out / f"audit_{name}.png")
        mlflow.log_artifact(str(fig))
    log.info("audit %s: eps >= %.3g at %.0f%% confidence (claimed %g): %s", name, bound.eps_lower,
             100 * a.confidence, eps, outcome.upper())
    return row


def run(cfg: DictConfig) -> pd.DataFrame:
    if cfg.get("task", "noisyhead") == "seqrec":  # one DP-SGD step of the next-item task: pipeline/seqrec/audit.py
        from pipeline.seqrec import audit as seqrec_audit

        return seqrec_audit.run(cfg)
    const, names = validate(cfg)  # before anything is created or computed
    if cfg.compute.threads:
        torch.set_num_threads(int(cfg.compute.threads))
    out = cell.output_dir()
    out.mkdir(parents=True, exist_ok=True)
    tracking.setup(cfg)
    rows = [audit_one(name, const, cfg, out) for name in names]
    table = pd.DataFrame(rows)
    table.to_csv(out / "audit.csv", index=False)
    shown = table[["method", "eps", "delta", "noise_scale", "runs", "eps_lower", "eps_ceiling", "eps_power", "tpr", "fpr", "verdict"]]
    log.info("audit at %.0f%% confidence:\n%s\nwrote %s", 100 * cfg.audit.confidence,
             shown.to_string(index=False, float_format=lambda x: f"{x:.4g}"), out / "audit.csv")
    return table


@hydra.main(version_base="1.3", config_path="../conf", config_name="audit")
def main(cfg: DictConfig) -> None:
    try:
        run(cfg)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    from pipeline.overrides import unknown_choice

    if (message := unknown_choice(sys.argv[1:])) is not None:
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)
    main()
