"""NoisyHead (Algorithm 1): noisy, clipped, projected gradient descent.

Privacy: each update's l2-sensitivity is eta0 sigma / N with sigma = 2 G (C + R G)
(``privacy.noisyhead_sensitivity``), guaranteed by the clipped, projected features
of ``Problem.private`` and the projection Pi_R of every iterate. The Gaussian noise
z_t = s xi_t ~ N(0, s^2 I) is drawn here (xi) and added in ``descent``, with s from
``privacy.noisyhead_step_std`` (``privacy.accountant``: basic composition over the T steps, as
in the paper, or the tight composition of the T Gaussian steps). The eps that dp-accounting's
PLD accountant gives for the noise actually used is logged as ``spent_eps``.
"""

from __future__ import annotations

import torch

from pipeline import privacy, rng
from pipeline.methods.base import Fit, chunks
from pipeline.methods.descent import Quadratic, descend, initial_gamma, run


PRIVATE = True


def fit(problem, const, cfg, spec=None, stream: str = "") -> Fit:
    """``stream`` names the random streams of the start and the noise (a second, independent
    run on the same data uses another)."""
    B, N, D = problem.private.shape
    dtype = problem.private.q.dtype
    eps, delta = float(cfg.privacy.eps), float(cfg.privacy.delta)
    accountant = cfg.privacy.accountant
    stds = tuple(
        privacy.noisyhead_step_std(eta0=const.eta0, sigma=const.sigma, N=N, T=T, eps=eps, delta=delta,
                                   accountant=accountant)
        for T in const.T
    )
    Delta = privacy.step_sensitivity(eta0=const.eta0, sigma=const.sigma, N=N)
    spent = [privacy.spent_epsilon(multiplier=s / Delta, T=T, delta=delta) for s, T in zip(stds, const.T)]
    T_max = max(const.T)
    step = dict(lam=const.lam, eta0=const.eta0, radius=const.R)
    parts, trace = [], []
    for i, sl in chunks(B, cfg.compute.chunk_trials, "noisyhead"):
        b = sl.stop - sl.start
        gamma0 = initial_gamma(trials=b, D=D, scale=const.init_scale, R=const.R,
                               gen=rng.generator(cfg.seed, "init" + stream, i), dtype=dtype)
        xi = rng.randn((b, T_max, D, D), rng.generator(cfg.seed, "noise:noisyhead" + stream, i), dtype)
        quad = Quadratic(problem.private[sl])
        parts.append(run(quad, gamma0, T=const.T, noise_std=stds, noise=xi, **step))
        if i == 0:  # the training-loss curve of the first trial, longest horizon
            longest = max(range(len(stds)), key=const.T.__getitem__)
            trace = descend(quad.subset(torch.tensor([0])), gamma0[:1], T=(T_max,),
                            noise_std=(stds[longest],), noise=xi[:1], **step)[1]
    params = {
        "accountant": cfg.privacy.accountant,
        "sigma": const.sigma,
        "step_sensitivity": privacy.step_sensitivity(eta0=const.eta0, sigma=const.sigma, N=N),
        "noise_std": ",".join(f"{s:.6g}" for s in stds),
        "spent_eps": ",".join(f"{e:.6g}" for e in spent),  # the PLD accountant's eps at delta for this noise
    }
    if accountant == "basic":
        params |= {"step_eps": ",".join(f"{eps / T:.6g}" for T in const.T),
                   "step_delta": ",".join(f"{delta / T:.6g}" for T in const.T)}
    return Fit(gamma=torch.cat(parts), private=True, params=params, trace=trace)
