"""The multi-run audit's statistics, for every task's empirical privacy audit (``python -m pipeline.audit``).

An audit runs a mechanism many times on each of two neighbouring inputs, reduces each output to a
scalar statistic, and asks how well a threshold on it tells the two inputs apart. This module
turns the two samples of the statistic into a lower bound on the mechanism's eps and a verdict:

1. on a first ``audit.select_fraction`` of the runs, pick the rejection region {s > t} or {s < t},
   and which input plays "in", that maximise the Clopper-Pearson lower bound on eps below;
2. on the remaining, untouched runs, count how often each input lands in that region and report
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

What each task audits (its neighbouring inputs, mechanism and statistic) is its ``audit`` module:
``pipeline/noisyhead/audit.py``, ``pipeline/seqrec/audit.py``.

The one-run tests (a whole DP-SGD training with m canaries) are ``pipeline.audit.one_run``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from omegaconf import DictConfig
from scipy.stats import beta, norm

from pipeline import privacy
from pipeline.validation import ConfigError, positive_int


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


def check_keys(a: DictConfig) -> None:
    """The audit's own keys (both tasks)."""
    positive_int(a.runs, "audit.runs")
    for name, runs in (a.runs_for or {}).items():
        positive_int(runs, f"audit.runs_for.{name}")
    if not 0 < a.select_fraction < 1:
        raise ConfigError(f"audit.select_fraction must lie in (0, 1), got {a.select_fraction!r}")
    if not 0 < a.confidence < 1:
        raise ConfigError(f"audit.confidence must lie in (0, 1), got {a.confidence!r}")
    if isinstance(a.power_factor, bool) or not isinstance(a.power_factor, (int, float)) or not a.power_factor > 1:
        raise ConfigError(f"audit.power_factor must be a number > 1, got {a.power_factor!r}")
    if isinstance(a.noise_scale, bool) or not isinstance(a.noise_scale, (int, float)) or not a.noise_scale > 0:
        raise ConfigError(f"audit.noise_scale must be a positive number, got {a.noise_scale!r}")
    if not isinstance(a.get("plan_only", False), bool):
        raise ConfigError(f"audit.plan_only must be true or false, got {a.get('plan_only')!r}")
