"""The evaluate step: excess risk against the ridge oracle, and absolute test MSE.

Excess risk of an estimate (equation 7.1): (1/n_test) sum_k <Gamma_hat - Gamma*, Z_test_k>^2
on fresh, unclipped test prompts, one value per trial; the table reports its mean,
standard deviation across trials, a normal-approximation confidence interval for the
mean, and the mean and sd of log10 of the per-trial values (for log-scale plots).
"""

from __future__ import annotations

import math
from statistics import NormalDist

import pandas as pd
import torch
from torch import Tensor

from pipeline import tracking
from pipeline.features import Features
from pipeline.methods.base import Fit

# The columns every later step reads; one row per (cell, method, T).
COLUMNS = [
    "regime", "dataset", "attack", "method", "private", "N", "L", "D", "eps", "delta", "T", "B",
    "lam", "eta0", "C", "G", "R", "sigma", "noise_std", "n_test", "seed", "oracle",
    "excess_risk_mean", "excess_risk_sd", "excess_risk_ci_low", "excess_risk_ci_high",
    "log10_excess_mean", "log10_excess_sd", "test_mse_mean", "test_mse_sd",
]


def per_trial(gamma: Tensor, oracle: Tensor, test: Features, chunk: int) -> tuple[Tensor, Tensor]:
    """Per-trial excess risk and test MSE of gamma (B, M, D, D) against oracle (B, 1, D, D): (B, M) each."""
    excess, mse = [], []
    for start in range(0, gamma.shape[0], chunk):
        sl = slice(start, start + chunk)
        t = test[sl]
        pred = t.inner(gamma[sl])
        excess.append((pred - t.inner(oracle[sl])).square().mean(-1))
        mse.append((pred - t.y.unsqueeze(1)).square().mean(-1))
    return torch.cat(excess), torch.cat(mse)


def summarize(values: Tensor, level: float) -> dict[str, float]:
    """Mean, sd (across trials) and a level-CI of the mean for values (B,)."""
    values = values.double()
    B = values.numel()
    mean = values.mean().item()
    sd = values.std().item() if B > 1 else 0.0
    half = NormalDist().inv_cdf(0.5 + level / 2) * sd / math.sqrt(B)
    return {"mean": mean, "sd": sd, "ci_low": mean - half, "ci_high": mean + half}


def run(problem, fits: dict[str, Fit], const, cfg) -> pd.DataFrame:
    oracle = fits["ridge"].gamma
    chunk = cfg.compute.chunk_trials
    level = float(cfg.evaluate.ci_level)
    rows = []
    for name, fit in fits.items():
        excess, mse = per_trial(fit.gamma, oracle, problem.test, chunk)
        stds = str(fit.params.get("noise_std", "")).split(",")
        for i, T in enumerate(const.T):
            j = i if fit.gamma.shape[1] > 1 else 0  # an estimate that does not depend on T serves every T
            e = summarize(excess[:, j], level)
            m = summarize(mse[:, j], level)
            positive = excess[:, j][excess[:, j] > 0]
            logs = positive.log10() if positive.numel() == excess.shape[0] else None
            rows.append({
                "regime": cfg.regime.name, "dataset": cfg.dataset.name, "attack": cfg.attack.name,
                "method": name, "private": fit.private, "N": const.N, "L": const.L, "D": const.D,
                "eps": float(cfg.privacy.eps), "delta": float(cfg.privacy.delta), "T": T, "B": cfg.trials,
                "lam": const.lam, "eta0": const.eta0, "C": const.C, "G": const.G, "R": const.R,
                "sigma": const.sigma, "noise_std": float(stds[j]) if fit.private else 0.0,
                "n_test": cfg.dataset.n_test, "seed": cfg.seed, "oracle": cfg.oracle,
                **{f"excess_risk_{k}": v for k, v in e.items()},
                "log10_excess_mean": logs.mean().item() if logs is not None else math.nan,
                "log10_excess_sd": logs.std().item() if logs is not None and logs.numel() > 1 else math.nan,
                "test_mse_mean": m["mean"], "test_mse_sd": m["sd"],
            })
            metrics = {f"{name}.excess_risk_{k}": v for k, v in e.items()}
            metrics |= {f"{name}.test_mse_mean": m["mean"], f"{name}.test_mse_sd": m["sd"]}
            tracking.log_metrics("evaluate", metrics, at=T if len(const.T) > 1 else None)
    return pd.DataFrame(rows, columns=COLUMNS)
