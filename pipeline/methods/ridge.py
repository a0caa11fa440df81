"""The non-private ridge oracle Gamma* (equation 2.7) on raw features.

Gamma* solves (H + mu I) vec(Gamma) = b with H = (1/N) sum_k vec(Z_k) vec(Z_k)^T and
b = (1/N) sum_k y_k vec(Z_k), i.e. (mu N I + sum_k vec(Z_k) vec(Z_k)^T)^{-1} sum_k y_k vec(Z_k).

Which mu is the oracle's is the config's ``oracle`` choice:
- ``update``: mu = 2 lam, the minimiser of F(Gamma) = (1/2N) sum (<Gamma, Z> - y)^2 + lam ||Gamma||^2,
  the objective Algorithm 1's update descends; non-private GD converges to it.
- ``printed``: mu = lam, equation (2.7) to the letter (the minimiser of (2.6)); GD then
  converges to a different point and its excess risk stalls at a small floor.

The primal system is D^2 x D^2; the dual one is N x N, vec(Gamma) = Z^T (K + mu N I)^{-1} y
with K_jk = <Z_j, Z_k>. Whichever costs fewer flops is solved.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pipeline.features import Features
from pipeline.methods.base import Fit, chunks


def penalty(lam: float, oracle: str) -> float:
    return 2 * lam if oracle == "update" else lam


def solve(feats: Features, mu: float) -> Tensor:
    """argmin over Gamma of (1/2N) sum_k (<Gamma, Z_k> - y_k)^2 + (mu/2) ||Gamma||^2: (B, D, D)."""
    B, N, D = feats.shape
    if 2 * N * D**4 + D**6 / 3 <= 4 * N**2 * D + N**3 / 3:
        A = feats.gram() + mu * torch.eye(D * D, dtype=feats.q.dtype)
        rhs = feats.moment().reshape(B, D * D, 1)
        return torch.cholesky_solve(rhs, torch.linalg.cholesky(A)).reshape(B, D, D)
    # Dual: vec(Gamma) = Z^T (Z Z^T + mu N I)^{-1} y
    A = feats.kernel() + mu * N * torch.eye(N, dtype=feats.q.dtype)
    alpha = torch.cholesky_solve(feats.y.unsqueeze(-1), torch.linalg.cholesky(A)).squeeze(-1)
    return feats.combine(alpha.unsqueeze(1)).squeeze(1)


def fit(problem, const, cfg) -> Fit:
    mu = penalty(const.lam, cfg.oracle)
    parts = [solve(problem.train[sl], mu) for _, sl in chunks(problem.trials, cfg.compute.chunk_trials, "ridge")]
    return Fit(gamma=torch.cat(parts).unsqueeze(1), private=False, params={"ridge_penalty": mu})
