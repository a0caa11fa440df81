"""NoisyHead (Algorithm 1): noisy, clipped, projected gradient descent.

Privacy: each update's l2-sensitivity is eta0 sigma / N with sigma = 2 G (C + R G)
(``privacy.noisyhead_sensitivity``), guaranteed by the clipped, projected features
of ``Problem.private`` and the projection Pi_R of every iterate. The Gaussian noise
z_t ~ N(0, s^2 I) is added here, in ``descend``, with s from
``privacy.noisyhead_step_std`` (basic composition over the T steps).
"""

from __future__ import annotations

import torch

from pipeline import privacy, rng
from pipeline.methods.base import Fit, chunks
from pipeline.methods.descent import Quadratic, descend, initial_gamma


def fit(problem, const, cfg) -> Fit:
    B, N, D = problem.private.shape
    dtype = problem.private.q.dtype
    eps, delta = float(cfg.privacy.eps), float(cfg.privacy.delta)
    stds = tuple(
        privacy.noisyhead_step_std(eta0=const.eta0, sigma=const.sigma, N=N, T=T, eps=eps, delta=delta)
        for T in const.T
    )
    gram = Quadratic.prefers_gram(N, D, sum(const.T))
    parts, trace = [], []
    for i, sl in chunks(B, cfg.compute.chunk_trials, "noisyhead"):
        gamma0 = initial_gamma(
            trials=sl.stop - sl.start, D=D, scale=const.init_scale, R=const.R,
            gen=rng.generator(cfg.seed, "init", i), dtype=dtype,
        )
        gamma, tr = descend(
            Quadratic(problem.private[sl], gram), gamma0, lam=const.lam, eta0=const.eta0, T=const.T,
            radius=const.R, noise_std=stds, gen=rng.generator(cfg.seed, "noise:noisyhead", i),
        )
        parts.append(gamma)
        trace = trace or tr
    params = {
        "accountant": cfg.privacy.accountant,
        "sigma": const.sigma,
        "step_sensitivity": privacy.step_sensitivity(eta0=const.eta0, sigma=const.sigma, N=N),
        "noise_std": ",".join(f"{s:.6g}" for s in stds),
        "step_eps": ",".join(f"{eps / T:.6g}" for T in const.T),
        "step_delta": ",".join(f"{delta / T:.6g}" for T in const.T),
    }
    return Fit(gamma=torch.cat(parts), private=True, params=params, trace=trace)
