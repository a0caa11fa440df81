"""Projected, optionally noisy, gradient descent on Algorithm 1's objective, written once.

The update of Algorithm 1 is

    Gamma^{t+1} = Pi_R((1 - 2 lam eta0) Gamma^t - (eta0/N) sum_k (<Gamma^t, Z_k> - y_k) Z_k + z_t),

i.e. a gradient step on F(Gamma) = (1/2N) sum_k (<Gamma, Z_k> - y_k)^2 + lam ||Gamma||_F^2.
Non-private GD is the same update on raw features with no projection and no noise;
NoisyHead runs it on clipped, projected features with Gaussian z_t.

Several horizons T can run side by side: each is its own trajectory with its own
noise scale s_T, z_t = s_T xi_t, on standard normals xi_t common to all horizons of
a trial (common random numbers: each horizon's noise is exactly N(0, s_T^2 I), and
the curve across T is smoother). ``run`` evaluates them in closed form when it can
prove that to be exact (``pipeline/noisyhead/methods/closed_form.py``), else step by step.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from pipeline import rng
from pipeline.noisyhead.features import Features, project_frobenius
from pipeline.noisyhead.methods.base import steps as progress

if TYPE_CHECKING:
    from torch import Tensor


class Quadratic:
    """The data term f(Gamma) = (1/2N) sum_k (<Gamma, Z_k> - y_k)^2 and its gradient H Gamma - b.

    With ``gram=True`` H = (1/N) sum_k vec(Z_k) vec(Z_k)^T is formed once (cheap
    per step, D^4 memory); otherwise H is applied through the factored features
    (no set-up, 4 N D^2 work per product).
    """

    def __init__(self, feats: Features, gram: bool = False):
        self.feats = feats
        self.b = feats.moment()
        self.c = 0.5 * feats.y.square().mean(-1)
        self.H = feats.gram() if gram else None

    def for_products(self, products: int) -> "Quadratic":
        """Form H now if that is cheaper than ``products`` factored products per trial."""
        _, N, D = self.feats.shape
        if self.H is None and self.prefers_gram(N, D, products):
            self.H = self.feats.gram()
        return self

    def subset(self, trials: Tensor) -> "Quadratic":
        """The same quadratic for a subset of the trials (an index tensor)."""
        sub = object.__new__(Quadratic)
        sub.feats = Features(self.feats.q[trials], self.feats.v[trials], self.feats.y[trials])
        sub.b, sub.c = self.b[trials], self.c[trials]
        sub.H = None if self.H is None else self.H[trials]
        return sub

    @staticmethod
    def prefers_gram(N: int, D: int, steps: int) -> bool:
        """Whether forming H is cheaper than ``steps`` factored products (per trial and matrix)."""
        return 2 * N * D**4 + 2 * steps * D**4 < 4 * steps * N * D**2

    def apply(self, gamma: Tensor) -> Tensor:
        """H Gamma for gamma (B, M, D, D)."""
        if self.H is not None:
            B, M, D, _ = gamma.shape
            return (self.H @ gamma.reshape(B, M, D * D).mT).mT.reshape(B, M, D, D)
        return self.feats.combine(self.feats.inner(gamma)) / self.feats.y.shape[-1]

    def norm_bound(self) -> Tensor:
        """An upper bound on ||H||_2 per trial: trace(H) = mean_k ||Z_k||_F^2 (H is PSD): (B,)."""
        return self.feats.norms().square().mean(-1)

    def grad(self, gamma: Tensor) -> tuple[Tensor, Tensor]:
        """Gradient (B, M, D, D) and value (B, M) of f at gamma (B, M, D, D)."""
        Hg = self.apply(gamma)
        b = self.b.unsqueeze(1)
        value = (gamma * (0.5 * Hg - b)).sum((-2, -1)) + self.c.unsqueeze(1)
        return Hg - b, value


def update(quad: Quadratic, gamma: Tensor, *, lam: float, eta0: float) -> tuple[Tensor, Tensor]:
    """One step before noise and projection, (1 - 2 lam eta0) Gamma - eta0 grad f(Gamma),
    and the objective F(Gamma) = f(Gamma) + lam ||Gamma||^2 at the starting point: (B, M, D, D), (B, M)."""
    grad, value = quad.grad(gamma)
    return (1 - 2 * lam * eta0) * gamma - eta0 * grad, value + lam * gamma.square().sum((-2, -1))


def initial_gamma(*, seed: int, stream: str, trials: slice, D: int, scale: float, R: float, dtype,
                  device=None) -> Tensor:
    """Gamma^0 = Pi_R(scale * N(0, I)) for the trials of a chunk, each from its own generator in
    ``stream``: data independent (the authors' code), (len(trials), D, D), on ``device``."""
    return project_frobenius(scale * rng.trial_normal(seed, stream, trials, (D, D), dtype, device), R)


def descend(
    quad: Quadratic,
    gamma0: Tensor,
    *,
    lam: float,
    eta0: float,
    T: tuple[int, ...],
    radius: float = math.inf,
    noise_std: tuple[float, ...] | None = None,
    noise: Tensor | None = None,
) -> tuple[Tensor, list[float]]:
    """Run the update step by step from gamma0 (B, D, D); return Gamma^T for every T, (B, len(T), D, D).

    ``noise`` holds the standard normals xi_t, (B, max(T), D, D); horizon j adds
    noise_std[j] * xi_t at step t. Also returns the objective F(Gamma^t),
    t = 0..max(T)-1, of the first trial's longest horizon (the training-loss curve).
    """
    order = sorted(range(len(T)), key=T.__getitem__)
    horizons = [T[j] for j in order]
    private = noise_std is not None
    M = len(T) if private else 1
    B, D, _ = gamma0.shape
    gamma = gamma0.unsqueeze(1).expand(B, M, D, D).clone()
    if private:
        std = gamma0.new_tensor([noise_std[j] for j in order]).view(1, M, 1, 1)
    out = gamma0.new_empty(B, len(T), D, D)
    trace: list[float] = []
    done = 0  # horizons reached so far; the private trajectories still running are gamma[:, done:]
    for t in progress(horizons[-1], "descent steps"):
        first = done if private else 0
        g, value = update(quad, gamma[:, first:], lam=lam, eta0=eta0)
        trace.append(float(value[0, -1]))
        if private:
            g += std[:, first:] * noise[:, t].unsqueeze(1)
        if math.isfinite(radius):
            g = project_frobenius(g, radius)
        gamma[:, first:] = g
        while done < len(horizons) and horizons[done] == t + 1:
            out[:, order[done]] = gamma[:, done if private else 0]
            done += 1
    return out, trace


def run(
    quad: Quadratic,
    gamma0: Tensor,
    *,
    lam: float,
    eta0: float,
    T: tuple[int, ...],
    radius: float = math.inf,
    noise_std: tuple[float, ...] | None = None,
    noise: Tensor | None = None,
) -> Tensor:
    """Gamma^T for every T, (B, len(T), D, D): in closed form where that is provably the
    same (no projection can act, and the series converges), step by step elsewhere."""
    from pipeline.noisyhead.methods import closed_form

    args = dict(lam=lam, eta0=eta0, T=T, radius=radius, noise_std=noise_std, noise=noise)
    terms = closed_form.terms(max(T) * eta0 * quad.norm_bound().max().item())
    # A single private horizon rarely stays clear of Pi_R (its noise is large), so only
    # deterministic runs and multi-horizon runs are worth a certificate.
    if terms is not None and (not math.isfinite(radius) or len(T) > 1):
        quad.for_products((terms + 1) * (2 + (len(T) if noise_std is not None else 0)))
        gamma = closed_form.evaluate(quad, gamma0, terms=terms, **args)
        exact = closed_form.certified(quad, gamma0, **args)
        if not exact.all():  # trials where some horizon may meet Pi_R: step by step, same noise
            redo = (~exact).nonzero().squeeze(-1)
            sub = dict(args, noise=None if noise is None else noise[redo])
            gamma[redo] = descend(quad.subset(redo).for_products(_steps(T, noise_std)), gamma0[redo], **sub)[0]
        return gamma
    return descend(quad.for_products(_steps(T, noise_std)), gamma0, **args)[0]


def _steps(T: tuple[int, ...], noise_std) -> int:
    """Products by H per trial of a step-by-step run: one trajectory per horizon when private."""
    return sum(T) if noise_std is not None else max(T)
