"""Projected, optionally noisy, gradient descent on Algorithm 1's objective, written once.

The update of Algorithm 1 is

    Gamma^{t+1} = Pi_R((1 - 2 lam eta0) Gamma^t - (eta0/N) sum_k (<Gamma^t, Z_k> - y_k) Z_k + z_t),

i.e. a gradient step on F(Gamma) = (1/2N) sum_k (<Gamma, Z_k> - y_k)^2 + lam ||Gamma||_F^2.
Non-private GD is the same update on raw features with no projection and no noise;
NoisyHead runs it on clipped, projected features with Gaussian z_t.

Several horizons T can run side by side: each is its own trajectory (its own
noise scale), and a trajectory stops being updated once it reaches its T. A
deterministic run needs one trajectory, read off at every T.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from pipeline import rng
from pipeline.features import Features, project_frobenius


class Quadratic:
    """The data term f(Gamma) = (1/2N) sum_k (<Gamma, Z_k> - y_k)^2 and its gradient H Gamma - b.

    With ``gram=True`` H = (1/N) sum_k vec(Z_k) vec(Z_k)^T is formed once (cheap
    per step, D^4 memory); otherwise the gradient is taken through the factored
    features (no set-up, 2 N D^2 work per product).
    """

    def __init__(self, feats: Features, gram: bool):
        self.feats = feats
        self.b = feats.moment()
        self.c = 0.5 * feats.y.square().mean(-1)
        self.H = feats.gram() if gram else None

    @staticmethod
    def prefers_gram(N: int, D: int, steps: int) -> bool:
        """Whether forming H is cheaper than ``steps`` factored gradient evaluations."""
        return 2 * N * D**4 + 2 * steps * D**4 < 4 * steps * N * D**2

    def grad(self, gamma: Tensor) -> tuple[Tensor, Tensor]:
        """Gradient (B, M, D, D) and value (B, M) of f at gamma (B, M, D, D)."""
        if self.H is not None:
            B, M, D, _ = gamma.shape
            Hg = (self.H @ gamma.reshape(B, M, D * D).mT).mT.reshape(B, M, D, D)
            value = 0.5 * (gamma * Hg).sum((-2, -1)) - (gamma * self.b.unsqueeze(1)).sum((-2, -1))
            return Hg - self.b.unsqueeze(1), value + self.c.unsqueeze(1)
        r = self.feats.inner(gamma) - self.feats.y.unsqueeze(1)
        return self.feats.combine(r) / r.shape[-1], 0.5 * r.square().mean(-1)


def initial_gamma(*, trials: int, D: int, scale: float, R: float, gen, dtype) -> Tensor:
    """Gamma^0 = Pi_R(scale * N(0, I)): data independent (the authors' code), (B, D, D)."""
    return project_frobenius(scale * rng.randn((trials, D, D), gen, dtype), R)


def descend(
    quad: Quadratic,
    gamma0: Tensor,
    *,
    lam: float,
    eta0: float,
    T: tuple[int, ...],
    radius: float = math.inf,
    noise_std: tuple[float, ...] | None = None,
    gen: torch.Generator | None = None,
) -> tuple[Tensor, list[float]]:
    """Run the update from gamma0 (B, D, D) and return Gamma^T for every T: (B, len(T), D, D).

    Also returns the objective F(Gamma^t), t = 0..max(T)-1, of the first trial's
    longest trajectory (the training-loss curve).
    """
    order = sorted(range(len(T)), key=T.__getitem__)
    horizons = [T[j] for j in order]
    private = noise_std is not None
    M = len(T) if private else 1
    B, D, _ = gamma0.shape
    gamma = gamma0.unsqueeze(1).expand(B, M, D, D).clone()
    if private:
        std = torch.tensor([noise_std[j] for j in order], dtype=gamma.dtype).view(1, M, 1, 1)
    out = gamma0.new_empty(B, len(T), D, D)
    trace: list[float] = []
    done = 0  # horizons reached so far; the private trajectories still running are gamma[:, done:]
    for t in range(horizons[-1]):
        first = done if private else 0
        g = gamma[:, first:]
        grad, value = quad.grad(g)
        trace.append(float(value[0, -1] + lam * g[0, -1].square().sum()))
        g = (1 - 2 * lam * eta0) * g - eta0 * grad
        if private:
            g += std[:, first:] * rng.randn(g.shape, gen, g.dtype)
        if math.isfinite(radius):
            g = project_frobenius(g, radius)
        gamma[:, first:] = g
        while done < len(horizons) and horizons[done] == t + 1:
            out[:, order[done]] = gamma[:, done if private else 0]
            done += 1
    return out, trace
