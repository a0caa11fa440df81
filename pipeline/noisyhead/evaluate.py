"""The evaluate step: excess risk against the ridge oracle, absolute test MSE, and, under
an attack, the risk the attack causes.

Excess risk of an estimate (equation 7.1): (1/n_test) sum_k <Gamma_hat - Gamma*, Z_test_k>^2 on
fresh, unclipped test prompts, one value per trial. Attack risk (Section 6.3, Risk_DP and
Risk_Ridge): (1/n_test) sum_k <Gamma_hat - Gamma_hat_bad, Z_test_k>^2, clean against attacked
fit of the same method. Each is summarised by its mean, its standard deviation across trials,
a normal-approximation confidence interval for the mean, and the mean and sd of log10 of
the per-trial values (for log-scale plots).
"""

from __future__ import annotations

import math
from statistics import NormalDist

import pandas as pd
import torch
from torch import Tensor

from pipeline import tracking
from pipeline.noisyhead import attacks
from pipeline.noisyhead.features import Features
from pipeline.noisyhead.methods.base import Fit

STATS = ("mean", "sd", "ci_low", "ci_high")
METRICS = ("excess_risk", "test_mse", "attack_risk")

# The columns every later step reads; one row per (cell, method, T, coupling).
COLUMNS = [
    "regime", "dataset", "attack", "method", "private", "coupling", "N", "L", "D", "eps", "delta", "T", "B",
    "lam", "eta0", "C", "G", "R", "sigma", "noise_std", "n_test", "seed", "oracle",
    "attack_mu", "attack_c", "attack_p", "attack_alpha",
    *(f"{m}_{s}" for m in METRICS for s in STATS),
    *(f"log10_{m}_{s}" for m in METRICS for s in ("mean", "sd")),
]


def _per_trial(measure, trials: int, chunk: int) -> Tensor:
    """measure(slice of trials) -> (b, M), over chunks of trials: (B, M)."""
    return torch.cat([measure(slice(start, start + chunk)) for start in range(0, trials, chunk)])


def gap(a: Tensor, b: Tensor, test: Features, chunk: int) -> Tensor:
    """Per trial (1/n_test) sum_k <a_m - b, Z_test_k>^2 for a (B, M, D, D), b (B, M or 1, D, D): (B, M)."""
    return _per_trial(lambda sl: (test[sl].inner(a[sl]) - test[sl].inner(b[sl])).square().mean(-1), a.shape[0], chunk)


def test_mse(gamma: Tensor, test: Features, chunk: int) -> Tensor:
    """Per trial (1/n_test) sum_k (y_k - <gamma_m, Z_test_k>)^2: (B, M)."""
    return _per_trial(lambda sl: (test[sl].inner(gamma[sl]) - test[sl].y.unsqueeze(1)).square().mean(-1),
                      gamma.shape[0], chunk)


def summarize(values: Tensor, level: float, name: str) -> dict[str, float]:
    """``name``_mean, _sd (across trials), _ci_low, _ci_high (level-CI of the mean), and the
    mean and sd of log10 (NaN unless every value is positive) for values (B,)."""
    values = values.double()
    B = values.numel()
    mean = values.mean().item()
    sd = values.std().item() if B > 1 else math.nan  # one trial: no spread to speak of (printed n/a)
    # one trial: no spread to estimate, so no interval (NaN), never a zero-width one
    half = NormalDist().inv_cdf(0.5 + level / 2) * sd / math.sqrt(B) if B > 1 else math.nan
    out = {f"{name}_mean": mean, f"{name}_sd": sd, f"{name}_ci_low": mean - half, f"{name}_ci_high": mean + half}
    logs = values.log10() if bool((values > 0).all()) else None
    out[f"log10_{name}_mean"] = logs.mean().item() if logs is not None else math.nan
    out[f"log10_{name}_sd"] = logs.std().item() if logs is not None and B > 1 else math.nan
    return out


ZERO = "zero"  # the reference row of every cell: the predictor Gamma = 0 (it predicts 0 for every query)


def run(problem, fits: dict[str, Fit], const, cfg, attacked: dict[str, dict[str, Fit]] | None = None) -> pd.DataFrame:
    """One row per (method, T, coupling) of the cell, and the zero predictor's row (``ZERO``): its
    excess risk against the same oracle on the same test prompts, computed like every method's
    (the yardstick a private estimator has to beat to be of use; no attack risk: it reads no data)."""
    oracle = fits["ridge"].gamma
    B, _, D, _ = oracle.shape
    fits = fits | {ZERO: Fit(gamma=torch.zeros(B, 1, D, D, dtype=oracle.dtype, device=oracle.device), private=False)}
    chunk = cfg.compute.chunk_trials
    level = float(cfg.evaluate.ci_level)
    spec = cfg.attack
    cell = {
        "regime": cfg.regime.name, "dataset": cfg.dataset.name, "attack": spec.name,
        "N": const.N, "L": const.L, "D": const.D, "eps": float(cfg.privacy.eps), "delta": float(cfg.privacy.delta),
        "B": cfg.trials, "lam": const.lam, "eta0": const.eta0, "C": const.C, "G": const.G, "R": const.R,
        "sigma": const.sigma, "n_test": cfg.dataset.n_test, "seed": cfg.seed, "oracle": cfg.oracle,
    }
    if attacked is not None:
        cell |= {"attack_mu": float(spec.mu), "attack_c": float(spec.c), "attack_p": float(spec.p),
                 "attack_alpha": attacks.alpha(spec, const.N)}
    rows = []
    for name, fit in fits.items():
        excess = gap(fit.gamma, oracle, problem.test, chunk)
        mse = test_mse(fit.gamma, problem.test, chunk)
        stds = str(fit.params.get("noise_std", "")).split(",")
        couplings = attacked[name] if attacked is not None and name != ZERO else {"": None}
        for coupling, bad in couplings.items():
            risk = gap(fit.gamma, bad.gamma, problem.test, chunk) if bad is not None else None
            for i, T in enumerate(fit.T or const.T):
                j = i if fit.gamma.shape[1] > 1 else 0  # an estimate that does not depend on T serves every T
                stats = summarize(excess[:, j], level, "excess_risk") | summarize(mse[:, j], level, "test_mse")
                if risk is not None:
                    stats |= summarize(risk[:, j], level, "attack_risk")
                std = float(stds[min(j, len(stds) - 1)]) if fit.private else 0.0
                rows.append(cell | {"method": name, "private": fit.private, "coupling": coupling, "T": T,
                                    "noise_std": std} | stats)
                key = name + (f".{coupling}" if coupling else "")
                metrics = {f"{key}.{k}": v for k, v in stats.items() if not k.startswith("log10") and math.isfinite(v)}
                tracking.log_metrics("evaluate", metrics, at=T if len(fit.T or const.T) > 1 else None)
    return pd.DataFrame(rows, columns=COLUMNS)
