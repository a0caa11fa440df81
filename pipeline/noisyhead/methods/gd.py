"""Non-private gradient descent ("cost of descent"): Algorithm 1's update on raw
features, with no clipping, no projection and no noise, from the same start."""

from __future__ import annotations

from pipeline import lazy
from pipeline.noisyhead.methods.base import Fit, chunks
from pipeline.noisyhead.methods.descent import Quadratic, descend, initial_gamma, run

torch = lazy.module("torch")  # imported at first use: the config's checks load this module (pipeline/lazy.py)


PRIVATE = False
ITERATIVE = True  # runs T steps: its time per step is logged


def fit(problem, const, cfg, spec=None, stream: str = "") -> Fit:
    """Deterministic given the data (and the shared start): ``stream`` is not used."""
    B, N, D = problem.train.shape
    dtype, device = problem.train.q.dtype, problem.train.q.device
    step = dict(lam=const.lam, eta0=const.eta0, T=const.T)
    parts, trace = [], []
    for i, sl in chunks(B, cfg.compute.chunk_trials, "gd"):
        gamma0 = initial_gamma(seed=cfg.seed, stream="init", trials=sl, D=D, scale=const.init_scale, R=const.R,
                               dtype=dtype, device=device)
        quad = Quadratic(problem.train[sl])
        parts.append(run(quad, gamma0, **step))
        if i == 0:  # the training-loss curve of the first trial
            trace = descend(quad.subset(torch.tensor([0], device=device)), gamma0[:1], **dict(step, T=(max(const.T),)))[1]
    return Fit(gamma=torch.cat(parts), private=False, trace=trace)
