"""Sufficient-statistics perturbation (SSP): noisy sum_k z_k z_k^T and sum_k y_k z_k, then the ridge solve.

On the private view (z_k = vec(Z~_k), ||z_k|| <= G; |y_k| <= C), the pair
(A, b) = (sum_k z_k z_k^T, sum_k y_k z_k) has l2-sensitivity ``privacy.ssp_sensitivity`` (derived
there; 2 C G in every paper regime). SSP releases both with one Gaussian mechanism,
A + s W, b + s w with W (D^2 x D^2) and w (D^2) i.i.d. standard normal and s the analytic Gaussian
calibration of that sensitivity (``privacy.gaussian_multiplier``), and then only post-processes:
A_hat = sym(A + s W) (off-diagonal noise variance s^2 / 2), and

    Gamma = (A_hat + mu N I)^{-1} b_hat,

the oracle's ridge system (penalty ``ridge.penalty``) on the noisy statistics, solved by Cholesky
when D^2 is small and by conjugate gradients through the factored features otherwise (the noise
matrix is drawn either way; the Gram matrix is never formed then). A trial whose noisy system is
not positive definite has A_hat's negative eigenvalues set to zero first (still post-processing);
``indefinite`` logs how many there were.

An adaptive penalty (AdaSSP, Wang 2018) spends part of the budget on lambda_min(A) to add
max(0, ||noise||_2 - lambda_min) to the penalty when the noise could make the system
ill-conditioned. Here the oracle's own penalty mu N already dwarfs the noise
(``noise_to_penalty``: ||s sym(W)||_2 / (mu N), measured on the first trial and logged), so
AdaSSP's extra penalty would be zero and its budget split a pure loss; it is not shipped.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pipeline import privacy, rng
from pipeline.methods import ridge
from pipeline.methods.base import Fit, chunks
from pipeline.methods.descent import Quadratic

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
    direct = N * d * d <= 50 * (2 * N * d + d * d)  # forming the Gram costs less than 50 CG iterations
    parts, indefinite, ratio = [], 0, 0.0
    for i, sl in chunks(B, cfg.compute.chunk_trials, spec.estimator):
        quad = Quadratic(problem.private[sl], gram=direct)
        b = sl.stop - sl.start
        gen = rng.generator(cfg.seed, "noise:ssp" + stream, i)
        W = rng.randn((b, d, d), gen, quad.b.dtype)
        w = rng.randn((b, D, D), gen, quad.b.dtype)
        noise = (W + W.mT) * (std / (2 * N))  # sym(s W) / N: the system below is divided by N
        rhs = quad.b + (std / N) * w  # the released sum_k y z, over N
        if i == 0:
            ratio = torch.linalg.matrix_norm(noise[0], ord=2).item() / mu
        gamma, ok = _solve(quad, noise, rhs, mu, direct)
        if not ok.all():  # clip A_hat's spectrum at zero: post-processing of the release
            indefinite += int((~ok).sum())
            A = quad.feats[~ok].gram() + noise[~ok]
            vals, vecs = torch.linalg.eigh(A)
            system = (vecs * vals.clamp(min=0).unsqueeze(-2)) @ vecs.mT + mu * torch.eye(d, dtype=A.dtype)
            gamma[~ok] = torch.linalg.solve(system, rhs[~ok].reshape(-1, d, 1)).reshape(-1, D, D)
        parts.append(gamma)
    Delta = privacy.ssp_sensitivity(C=const.C, G=const.G)
    params = {"penalty": mu, "sensitivity": Delta, "noise_std": f"{std:.6g}",
              "noise_to_penalty": f"{ratio:.3g}", "indefinite": indefinite,
              "spent_eps": f"{privacy.spent_epsilon(multiplier=std / Delta, T=1, delta=delta):.6g}"}
    return Fit(gamma=torch.cat(parts).unsqueeze(1), private=True, params=params)


def _solve(quad: Quadratic, noise: Tensor, rhs: Tensor, mu: float, direct: bool) -> tuple[Tensor, Tensor]:
    """(H + noise + mu I) vec(Gamma) = vec(rhs) per trial: Gamma (b, D, D) and whether it was solved
    (False where the noisy system is not positive definite)."""
    b, D, _ = rhs.shape
    d = D * D
    if direct:
        chol, info = torch.linalg.cholesky_ex(quad.H + noise + mu * torch.eye(d, dtype=rhs.dtype))
        return torch.cholesky_solve(rhs.reshape(b, d, 1), chol).reshape(b, D, D), info == 0

    def apply(p: Tensor) -> Tensor:
        return quad.apply(p) + (noise @ p.reshape(b, d, 1)).reshape(b, 1, D, D) + mu * p

    gamma, converged = ridge.conjugate_gradients(apply, rhs.unsqueeze(1), tol=1e-12, max_iter=200)
    return gamma.squeeze(1), converged
