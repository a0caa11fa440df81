"""The plain per-trial NumPy loop of one low-dimensional cell: the speed baseline.

The same protocol as the pipeline (Section 2 prompts, ridge oracle, non-private GD and
NoisyHead with the paper's constants, excess risk on fresh test prompts), written the
way one would first write it: one trial at a time, vectorised within the trial.
It shares no code with ``pipeline`` beyond the derived constants, so it doubles as
an independent check of the batched numbers.
"""

from __future__ import annotations

import math
import time

import numpy as np


def _features(x, y, L, clip=None, G=None):
    """Z_k = x_{k,L+1} (1/L sum_i y_{k,i} x_{k,i})^T flattened, and the targets."""
    if clip is not None:
        y = np.clip(y, -clip, clip)
    v = (y[:, :L, None] * x[:, :L]).sum(1) / L
    q = x[:, L]
    Z = (q[:, :, None] * v[:, None, :]).reshape(len(q), -1)
    if G is not None:
        norms = np.linalg.norm(Z, axis=1, keepdims=True)
        Z = Z * np.minimum(1.0, G / np.maximum(norms, 1e-300))
    return Z, y[:, L]


def _prompts(rng, n, L, D):
    x = rng.standard_normal((n, L + 1, D))
    x /= np.linalg.norm(x, axis=-1, keepdims=True)
    w = rng.standard_normal((n, D))
    return x, np.einsum("nld,nd->nl", x, w)


def _project(g, R):
    n = np.linalg.norm(g)
    return g if n <= R else g * (R / n)


def one_trial(rng, *, N, L, D, C, G, R, lam, eta0, T, noise_std, n_test, init_scale, penalty, clock):
    start = time.perf_counter()
    x, y = _prompts(rng, N, L, D)
    Z, yq = _features(x, y, L)
    Zp, yp = _features(x, y, L, clip=C, G=G)
    xt, yt = _prompts(rng, n_test, L, D)
    Zt, _ = _features(xt, yt, L)
    clock["prompts"] += time.perf_counter() - start
    star = np.linalg.solve(Z.T @ Z + penalty * N * np.eye(D * D), Z.T @ yq)
    g0 = _project(init_scale * rng.standard_normal(D * D), R)
    gd, nh = g0.copy(), g0.copy()
    for _ in range(T):
        gd = (1 - 2 * lam * eta0) * gd - eta0 / N * (Z.T @ (Z @ gd - yq))
        nh = (1 - 2 * lam * eta0) * nh - eta0 / N * (Zp.T @ (Zp @ nh - yp))
        nh = _project(nh + noise_std * rng.standard_normal(D * D), R)
    return np.mean((Zt @ (gd - star)) ** 2), np.mean((Zt @ (nh - star)) ** 2)


def run(const, *, eps: float, delta: float, trials: int, n_test: int, seed: int = 0, oracle: str = "update",
        clock: dict | None = None):
    """Per-trial excess risks of GD and NoisyHead, (trials, 2). ``clock["prompts"]`` gains the
    seconds spent drawing prompts and building their features."""
    T = const.T[0]
    noise_std = (
        math.sqrt(2 * math.log(1.25 * T / delta)) * T / eps * const.eta0 * 2 * const.G * (const.C + const.R * const.G) / const.N
    )
    rng = np.random.default_rng(seed)
    args = dict(N=const.N, L=const.L, D=const.D, C=const.C, G=const.G, R=const.R, lam=const.lam, eta0=const.eta0, T=T,
                noise_std=noise_std, n_test=n_test, init_scale=const.init_scale,
                penalty=2 * const.lam if oracle == "update" else const.lam,
                clock=clock if clock is not None else {"prompts": 0.0})
    return np.array([one_trial(rng, **args) for _ in range(trials)])
