"""Sufficient-statistics perturbation (SSP): noisy sum_k z_k z_k^T and sum_k y_k z_k, then the ridge solve.

On the private view (z_k = vec(Z~_k), ||z_k|| <= G; |y_k| <= C), the pair
(A, b) = (sum_k z_k z_k^T, sum_k y_k z_k) has l2-sensitivity ``privacy.ssp_sensitivity`` (derived
there; 2 C G in every paper regime). SSP releases both with one Gaussian mechanism,
A + s W, b + s w with W (D^2 x D^2) and w (D^2) i.i.d. standard normal and s the analytic Gaussian
calibration of that sensitivity (``privacy.gaussian_multiplier``), and then only post-processes:
A_hat = sym(A + s W) (off-diagonal noise variance s^2 / 2), and

    Gamma = (A_hat + mu N I)^{-1} b_hat,

the ridge system on the noisy statistics, solved by Cholesky when D^2 is small and by conjugate
gradients through the factored features otherwise (the noise matrix is drawn either way; the
Gram matrix is never formed then). The method's ``penalty`` picks mu:

- ``oracle``: the oracle's penalty (``ridge.penalty``). When the noise is large (high dimension,
  small eps) A_hat + mu N I can be indefinite; such a trial has A_hat's negative eigenvalues set
  to zero first (still post-processing; ``indefinite`` logs how many), at the cost of an
  eigendecomposition per trial.
- ``adaptive`` (default): AdaSSP's rule (Wang 2018), penalty = max(mu N, bound - lambda_min(A)), with
  ``bound`` a high-probability bound on the noise's spectral norm, so that A_hat + penalty I is
  positive definite with probability at least 1 - ``failure``. AdaSSP spends part of the budget
  on a noisy lambda_min(A); here lambda_min(A) is taken as its a-priori lower bound 0, which spends
  nothing (in these regimes sum z z^T is close to singular anyway). The bound: ||sym(W)||_2 <=
  ||W||_2 <= 2 sqrt(D^2) + t with probability at least 1 - exp(-t^2 / 2) for a square standard
  Gaussian W (Davidson and Szarek), t = sqrt(2 log(1 / failure)). Whenever the bound is below mu N
  (every low-dimensional cell, and eps >= 0.1 in the high-dimensional regime) this is exactly
  SSP with the oracle's penalty; ``noise_to_penalty`` logs ||s sym(W)||_2 / (mu N) on the first
  trial, and ``penalty`` the one used.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from pipeline import lazy, privacy, rng
from pipeline.noisyhead.methods import ridge
from pipeline.noisyhead.methods.base import Fit, chunks, noise_scale
from pipeline.noisyhead.methods.descent import Quadratic

if TYPE_CHECKING:
    from torch import Tensor

torch = lazy.module("torch")  # imported at first use: the config's checks load this module (pipeline/lazy.py)

PRIVATE = True
ITERATIVE = False  # a direct solve, no steps


def noise_std(spec, const, *, eps: float, delta: float) -> float:
    """s = sensitivity x the analytic Gaussian multiplier, times ``noise_scale`` (1 unless deliberately
    under-noised)."""
    scale = noise_scale(spec)
    return scale * privacy.ssp_sensitivity(C=const.C, G=const.G) * privacy.gaussian_multiplier(eps=eps, delta=delta)


PENALTIES = ("adaptive", "oracle")


def check(spec, cfg, const) -> str | None:
    if spec.penalty not in PENALTIES:
        return f"penalty must be one of {list(PENALTIES)}, got {spec.penalty!r}"
    failure = spec.failure
    if isinstance(failure, bool) or not isinstance(failure, (int, float)) or not 0 < failure < 1:
        return f"failure must lie in (0, 1), got {spec.failure!r}"
    return None


def noise_bound(std: float, d: int, failure: float) -> float:
    """||std sym(W)||_2 <= std (2 sqrt(d) + sqrt(2 log(1 / failure))) with probability >= 1 - failure."""
    return std * (2 * math.sqrt(d) + math.sqrt(2 * math.log(1 / failure)))


def fit(problem, const, cfg, spec, stream: str = "") -> Fit:
    eps, delta = float(cfg.privacy.eps), float(cfg.privacy.delta)
    std = noise_std(spec, const, eps=eps, delta=delta)
    B, N, D = problem.private.shape
    d = D * D
    mu = ridge.penalty(const.lam, cfg.oracle)
    if spec.penalty == "adaptive":  # in the 1/N-scaled system: bound / N
        mu = max(mu, noise_bound(std, d, float(spec.failure)) / N)
    direct = N * d * d <= 50 * (2 * N * d + d * d)  # forming the Gram costs less than 50 CG iterations
    parts, indefinite, ratio = [], 0, 0.0
    for i, sl in chunks(B, cfg.compute.chunk_trials, spec.estimator):
        quad = Quadratic(problem.private[sl], gram=direct)
        gens = rng.generators(cfg.seed, "noise:ssp" + stream, sl)  # per trial: W, then w
        W = rng.normal(gens, (d, d), quad.b.dtype, quad.b.device)
        w = rng.normal(gens, (D, D), quad.b.dtype, quad.b.device)
        noise = (W + W.mT) * (std / (2 * N))  # sym(s W) / N: the system below is divided by N
        rhs = quad.b + (std / N) * w  # the released sum_k y z, over N
        if i == 0:
            ratio = torch.linalg.matrix_norm(noise[0], ord=2).item() / ridge.penalty(const.lam, cfg.oracle)
        gamma, ok = _solve(quad, noise, rhs, mu, direct)
        if not ok.all():  # clip A_hat's spectrum at zero: post-processing of the release
            indefinite += int((~ok).sum())
            vals, vecs = torch.linalg.eigh(quad.feats[~ok].gram() + noise[~ok])
            inverse = 1 / (vals.clamp(min=0) + mu)  # of the clipped system, in A_hat's eigenbasis
            gamma[~ok] = (vecs @ (inverse.unsqueeze(-1) * (vecs.mT @ rhs[~ok].reshape(-1, d, 1)))).reshape(-1, D, D)
        parts.append(gamma)
    Delta = privacy.ssp_sensitivity(C=const.C, G=const.G)
    params = {"penalty_rule": spec.penalty, "penalty": mu, "sensitivity": Delta, "noise_std": f"{std:.6g}",
              "noise_to_penalty": f"{ratio:.3g}", "indefinite": indefinite,
              "spent_eps": f"{privacy.spent_epsilon(multiplier=std / Delta, T=1, delta=delta):.6g}"}
    return Fit(gamma=torch.cat(parts).unsqueeze(1), private=True, params=params)


def _solve(quad: Quadratic, noise: Tensor, rhs: Tensor, mu: float, direct: bool) -> tuple[Tensor, Tensor]:
    """(H + noise + mu I) vec(Gamma) = vec(rhs) per trial: Gamma (b, D, D) and whether it was solved
    (False where the noisy system is not positive definite)."""
    b, D, _ = rhs.shape
    d = D * D
    if direct:
        chol, info = torch.linalg.cholesky_ex(quad.H + noise + mu * torch.eye(d, dtype=rhs.dtype, device=rhs.device))
        return torch.cholesky_solve(rhs.reshape(b, d, 1), chol).reshape(b, D, D), info == 0

    def apply(p: Tensor) -> Tensor:
        return quad.apply(p) + (noise @ p.reshape(b, d, 1)).reshape(b, 1, D, D) + mu * p

    gamma, converged = ridge.conjugate_gradients(apply, rhs.unsqueeze(1), tol=1e-12, max_iter=200)
    return gamma.squeeze(1), converged
