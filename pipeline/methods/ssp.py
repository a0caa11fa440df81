"""Sufficient-statistics perturbation (SSP): noisy sum_k z_k z_k^T and sum_k y_k z_k, then the ridge solve.

On the private view (z_k = vec(Z~_k), ||z_k|| <= G; |y_k| <= C), the pair
(A, b) = (sum_k z_k z_k^T, sum_k y_k z_k) has l2-sensitivity ``privacy.ssp_sensitivity`` (derived
there; 2 C G in every paper regime). SSP releases both with one Gaussian mechanism,
A + s W, b + s w with W (D^2 x D^2) and w (D^2) i.i.d. standard normal and s the analytic Gaussian
calibration of that sensitivity (``privacy.gaussian_multiplier``), and then only post-processes:
A_hat = sym(A + s W) (off-diagonal noise variance s^2 / 2), and

    Gamma = (A_hat + mu N I)^{-1} b_hat,

the oracle's ridge system (penalty ``ridge.penalty``) on the noisy statistics. A trial whose
noisy system is not positive definite has A_hat's negative eigenvalues set to zero first (still
post-processing); ``indefinite`` logs how many there were.

An adaptive penalty (AdaSSP, Wang 2018) spends part of the budget on lambda_min(A) to add
max(0, ||noise||_2 - lambda_min) to the penalty when the noise could make the system
ill-conditioned. Here the oracle's own penalty mu N already dwarfs the noise
(``noise_to_penalty``: ||s sym(W)||_2 / (mu N), measured on the first trial and logged), so
AdaSSP's extra penalty would be zero and its budget split a pure loss; it is not shipped.
"""

from __future__ import annotations

import torch

from pipeline import privacy, rng
from pipeline.methods import ridge
from pipeline.methods.base import Fit, chunks

PRIVATE = True


def noise_std(spec, const, *, eps: float, delta: float) -> float:
    """s = sensitivity x the analytic Gaussian multiplier, times ``noise_scale`` (1 unless deliberately
    under-noised)."""
    scale = float(getattr(spec, "noise_scale", 1.0))
    return scale * privacy.ssp_sensitivity(C=const.C, G=const.G) * privacy.gaussian_multiplier(eps=eps, delta=delta)


def fit(problem, const, cfg, spec, stream: str = "") -> Fit:
    eps, delta = float(cfg.privacy.eps), float(cfg.privacy.delta)
    mu = ridge.penalty(const.lam, cfg.oracle)
    std = noise_std(spec, const, eps=eps, delta=delta)
    B, N, D = problem.private.shape
    d = D * D
    eye = torch.eye(d, dtype=problem.private.q.dtype)
    parts, indefinite, ratio = [], 0, 0.0
    for i, sl in chunks(B, cfg.compute.chunk_trials, spec.estimator):
        feats = problem.private[sl]
        b = sl.stop - sl.start
        gen = rng.generator(cfg.seed, "noise:ssp" + stream, i)
        W = rng.randn((b, d, d), gen, eye.dtype)
        w = rng.randn((b, d, 1), gen, eye.dtype)
        noise = std * (W + W.mT) / 2
        A = feats.gram() * N + noise  # the released sum_k z z^T, symmetrised
        rhs = feats.moment().reshape(b, d, 1) * N + std * w  # the released sum_k y z
        if i == 0:
            ratio = torch.linalg.matrix_norm(noise[0], ord=2).item() / (mu * N)
        system = A + mu * N * eye
        chol, info = torch.linalg.cholesky_ex(system)
        bad = info != 0
        if bad.any():  # clip A_hat's spectrum at zero: post-processing of the release
            indefinite += int(bad.sum())
            vals, vecs = torch.linalg.eigh(A[bad])
            system[bad] = (vecs * vals.clamp(min=0).unsqueeze(-2)) @ vecs.mT + mu * N * eye
            chol[bad] = torch.linalg.cholesky(system[bad])
        parts.append(torch.cholesky_solve(rhs, chol).reshape(b, D, D))
    params = {"penalty": mu, "sensitivity": privacy.ssp_sensitivity(C=const.C, G=const.G),
              "noise_std": f"{std:.6g}", "noise_to_penalty": f"{ratio:.3g}", "indefinite": indefinite,
              "spent_eps": f"{privacy.spent_epsilon(multiplier=std / privacy.ssp_sensitivity(C=const.C, G=const.G), T=1, delta=delta):.6g}"}
    return Fit(gamma=torch.cat(parts).unsqueeze(1), private=True, params=params)
