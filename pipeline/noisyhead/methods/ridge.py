"""The non-private ridge oracle Gamma* (equation 2.7) on raw features.

Gamma* solves (H + mu I) vec(Gamma) = b with H = (1/N) sum_k vec(Z_k) vec(Z_k)^T and
b = (1/N) sum_k y_k vec(Z_k), i.e. (mu N I + sum_k vec(Z_k) vec(Z_k)^T)^{-1} sum_k y_k vec(Z_k).

Which mu is the oracle's is the config's ``oracle`` choice:
- ``update``: mu = 2 lam, the minimiser of F(Gamma) = (1/2N) sum (<Gamma, Z> - y)^2 + lam ||Gamma||^2,
  the objective Algorithm 1's update descends; non-private GD converges to it.
- ``printed``: mu = lam, equation (2.7) to the letter (the minimiser of (2.6)); GD then
  converges to a different point and its excess risk stalls at a small floor.

Small systems are solved directly (QR of the D^2-column primal least-squares problem or
Cholesky of the N x N dual system, whichever is cheaper). Large ones are solved by conjugate gradients through the
factored features, to a relative residual of 1e-13: with lam = N / D the system is
nearly a multiple of the identity and CG needs a handful of products by H. A trial that
does not converge is solved directly.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from pipeline import lazy
from pipeline.noisyhead.features import Features
from pipeline.noisyhead.methods.base import Fit, chunks
from pipeline.noisyhead.methods.descent import Quadratic

if TYPE_CHECKING:
    from torch import Tensor

torch = lazy.module("torch")  # imported at first use: the config's checks load this module (pipeline/lazy.py)


def penalty(lam: float, oracle: str) -> float:
    return 2 * lam if oracle == "update" else lam


def solve(feats: Features, mu: float, *, method: str = "auto", tol: float = 1e-13, max_iter: int = 200) -> Tensor:
    """argmin over Gamma of (1/2N) sum_k (<Gamma, Z_k> - y_k)^2 + (mu/2) ||Gamma||^2: (B, D, D).

    ``method``: direct, cg, auto (direct when it costs less than 50 CG iterations), or
    normal_equations: a plain solve of the D^2 x D^2 normal equations of (2.7), which loses
    accuracy with an outlying prompt (kept to show what that does to Figure 4)."""
    B, N, D = feats.shape
    if method == "normal_equations":
        A = feats.gram() + mu * torch.eye(D * D, dtype=feats.q.dtype, device=feats.q.device)
        return torch.linalg.solve(A, feats.moment().reshape(B, D * D, 1)).reshape(B, D, D)
    if method == "direct" or (method == "auto" and min(_primal_cost(N, D), _dual_cost(N, D)) <= 50 * 4 * N * D * D):
        return solve_direct(feats, mu)
    quad = Quadratic(feats, gram=False)
    x, converged = conjugate_gradients(lambda p: quad.apply(p) + mu * p, quad.b.unsqueeze(1), tol=tol, max_iter=max_iter)
    x = x.squeeze(1)
    if not converged.all():
        x[~converged] = solve_direct(feats[~converged], mu)
    return x


def conjugate_gradients(apply, b: Tensor, *, tol: float, max_iter: int) -> tuple[Tensor, Tensor]:
    """Solve apply(x) = b for a symmetric positive definite operator, batched: b (B, M, D, D).
    Returns x and, per trial, whether its relative residual reached ``tol``."""
    B = b.shape[0]
    x, r = torch.zeros_like(b), b.clone()
    p, rs = r.clone(), r.square().sum((-2, -1), keepdim=True)
    target = (tol * b.flatten(1).norm(dim=-1)).square().view(B, 1, 1, 1)
    rs_next = rs
    for _ in range(max_iter):
        Ap = apply(p)
        step = rs / (p * Ap).sum((-2, -1), keepdim=True)
        x += step * p
        r -= step * Ap
        rs_next = r.square().sum((-2, -1), keepdim=True)
        if (rs_next <= target).all():
            break
        p = r + (rs_next / rs) * p
        rs = rs_next
    return x, (rs_next <= target).view(B)


def _primal_cost(N: int, D: int) -> float:
    return 2 * (N + D**2) * D**4


def _dual_cost(N: int, D: int) -> float:
    return 4 * N**2 * D + N**3 / 3


def solve_direct(feats: Features, mu: float) -> Tensor:
    """The same solution by a direct method, primal or dual, whichever is cheaper.

    Primal: Cholesky of the normal equations H + mu I when their condition number, at most
    1 + max_k ||Z_k||^2 / mu, is below 1e6; else least squares on [Z; sqrt(mu N) I] vec(Gamma) =
    [y; 0] by QR, which stays accurate with an outlying prompt (the normal equations square
    the condition number).
    Dual: Cholesky of K + mu N I, whose accuracy an outlier's large diagonal entry does not
    hurt (Cholesky is insensitive to diagonal scaling).

    The least-squares problem has full column rank (its sqrt(mu N) I rows), so it is solved by
    plain Householder QR (LAPACK gels). torch's default CPU driver, gelsy (QR with column pivoting),
    is not reproducible from one process to the next at a fixed thread count: Figure 4's ridge attack
    risk varied in its 12th significant digit from one rebuild to the next. gels gives the same bits
    for the same data and thread count (not across thread counts: the reduction order changes)."""
    B, N, D = feats.shape
    if _primal_cost(N, D) <= _dual_cost(N, D):
        if (feats.norms().square().max() / mu).item() < 1e6:
            A = feats.gram() + mu * torch.eye(D * D, dtype=feats.q.dtype, device=feats.q.device)
            rhs = feats.moment().reshape(B, D * D, 1)
            return torch.cholesky_solve(rhs, torch.linalg.cholesky(A)).reshape(B, D, D)
        ridge_rows = math.sqrt(mu * N) * torch.eye(D * D, dtype=feats.q.dtype, device=feats.q.device).expand(B, D * D, D * D)
        A = torch.cat([feats.flat(), ridge_rows], 1)
        rhs = torch.cat([feats.y, feats.y.new_zeros(B, D * D)], 1).unsqueeze(-1)
        return torch.linalg.lstsq(A, rhs, driver="gels").solution.reshape(B, D, D)
    # Dual: vec(Gamma) = Z^T (Z Z^T + mu N I)^{-1} y
    A = feats.kernel() + mu * N * torch.eye(N, dtype=feats.q.dtype, device=feats.q.device)
    alpha = torch.cholesky_solve(feats.y.unsqueeze(-1), torch.linalg.cholesky(A)).squeeze(-1)
    return feats.combine(alpha.unsqueeze(1)).squeeze(1)


PRIVATE = False
ITERATIVE = False  # a direct solve, no steps


def check(spec, cfg, const) -> str | None:
    solvers = ("auto", "direct", "cg", "normal_equations")
    if spec.get("solver", "auto") not in solvers:
        return f"solver must be one of {solvers}, got {spec.solver!r}"
    return None


def fit(problem, const, cfg, spec=None, stream: str = "") -> Fit:
    """Deterministic given the data (and the shared start): ``stream`` is not used."""
    mu = penalty(const.lam, cfg.oracle)
    method = spec.get("solver", "auto") if spec is not None else "auto"
    parts = [solve(problem.train[sl], mu, method=method) for _, sl in chunks(problem.trials, cfg.compute.chunk_trials, "ridge")]
    return Fit(gamma=torch.cat(parts).unsqueeze(1), private=False, params={"penalty": mu, "solver": method})
