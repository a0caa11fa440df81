"""NoisyHead (Algorithm 1): noisy, clipped, projected gradient descent.

Privacy: each update's l2-sensitivity is eta0 sigma / N with sigma = 2 G (C + R G)
(``privacy.noisyhead_sensitivity``), guaranteed by the clipped, projected features
of ``Problem.private`` and the projection Pi_R of every iterate. The Gaussian noise
z_t = s xi_t ~ N(0, s^2 I) is drawn here (xi) and added in ``descent``, with s from
``privacy.noisyhead_step_std`` (``privacy.accountant``: basic composition over the T steps, as
in the paper, or the tight composition of the T Gaussian steps). The eps that the T composed
Gaussian steps actually spend with the noise used (``privacy.spent_epsilon``) is logged as
``spent_eps``.

A method file may set its own ``accountant`` (else ``privacy.accountant``) and ``horizon``:
``regime`` runs the regime's T, ``bound`` the T that minimises Theorem 4.1's bound
(``bound_horizon``), a rule that reads only the public constants, never the data.
"""

from __future__ import annotations

import math

import numpy as np

from pipeline import lazy, privacy, rng
from pipeline.noisyhead.constants import FLOAT_MAX  # torch.finfo's, without importing torch to check a config
from pipeline.noisyhead.methods.base import Fit, chunks, noise_scale
from pipeline.noisyhead.methods.descent import Quadratic, descend, initial_gamma, run

torch = lazy.module("torch")  # imported at first use: the config's checks load this module (pipeline/lazy.py)


PRIVATE = True
ITERATIVE = True  # runs T steps: its time per step is logged
HORIZONS = ("regime", "bound")


def accountant_of(spec, cfg) -> str:
    return getattr(spec, "accountant", None) or cfg.privacy.accountant


def horizons(spec, const, cfg) -> tuple[int, ...]:
    """The T (one or more) this method runs for."""
    if getattr(spec, "horizon", "regime") == "regime":
        return const.T
    return (bound_horizon(const, eps=float(cfg.privacy.eps), delta=float(cfg.privacy.delta),
                          accountant=accountant_of(spec, cfg)),)


def bound_horizon(const, *, eps: float, delta: float, accountant: str, T_max: int = 100_000) -> int:
    """argmin over T of Theorem 4.1's bound (4.2) without its constant factor G0^2:
    (1 - eta0 lam)^T R^2 + D s_T^2, where s_T is the per-step noise std the accountant calibrates
    for T steps. (4.2) writes its noise term as sigma^2 eta0^2 D T^2 log(2T/delta) / (N^2 eps^2),
    D times the basic calibration's s_T^2 up to the constants under the logarithm; with the tight
    accountant s_T^2 = T (eta0 sigma z / N)^2 grows linearly in T instead of as T^2 log T, so the
    rule trains longer. Everything here is public (constants and budget), so the choice spends no
    privacy. ``basic`` only considers T > eps (per-step eps < 1)."""
    Delta = privacy.step_sensitivity(eta0=const.eta0, sigma=const.sigma, N=const.N)
    T = np.arange(1, T_max + 1, dtype=np.float64)
    if accountant == "tight":
        var = Delta**2 * privacy.gaussian_multiplier(eps=eps, delta=delta) ** 2 * T
    else:
        var = 2 * Delta**2 * T**2 * np.log(1.25 * T / delta) / eps**2
        var[T <= eps] = np.inf
    bound = (1 - const.eta0 * const.lam) ** T * const.R**2 + const.D * var
    return int(T[np.argmin(bound)])


def check(spec, cfg, const) -> str | None:
    accountant = accountant_of(spec, cfg)
    if accountant not in privacy.ACCOUNTANTS:
        return f"accountant {accountant!r} is unknown; known: {list(privacy.ACCOUNTANTS)}"
    horizon = getattr(spec, "horizon", "regime")
    if horizon not in HORIZONS:
        return f"horizon must be one of {list(HORIZONS)}, got {horizon!r}"
    eps = cfg.privacy.eps
    short = [t for t in horizons(spec, const, cfg) if eps / t >= 1]
    if short and accountant == "basic":
        return (f"privacy.eps = {eps} with T = {short[0]} gives a per-step eps of {eps / short[0]:.3g}; "
                "the basic accountant's Gaussian calibration is only proven for per-step eps < 1")
    budget = f"privacy.eps = {cfg.privacy.eps!r}, privacy.delta = {cfg.privacy.delta!r}"
    try:  # the fit's own calibration, before any compute (tight_multiplier is cached for the fit)
        Ts, stds, _ = calibrate(spec, const, cfg, const.N)
    except (ValueError, ArithmeticError) as err:  # a per-step budget that underflows, an accountant's overflow
        return f"{budget}: the noise cannot be calibrated ({err})"
    largest = math.sqrt(FLOAT_MAX[cfg.compute.dtype]) / (40 * const.D)  # the noise's squared norm
    for T, std in zip(Ts, stds):
        if not std < largest:  # NaN too
            return f"{budget}: the per-step noise std for T = {T} is {std:.3g}, too large to compute with"
        if std <= 0 and noise_scale(spec) > 0:  # noise_scale = 0 removes the noise on purpose
            return f"{budget}: the per-step noise std for T = {T} underflows to {std:g}"
    return None


def calibrate(spec, const, cfg, N: int) -> tuple[tuple[int, ...], tuple[float, ...], list[float]]:
    """The horizons T, the per-step noise std for each (times ``noise_scale``) and the eps that
    noise spends at ``privacy.delta``."""
    eps, delta = float(cfg.privacy.eps), float(cfg.privacy.delta)
    accountant = accountant_of(spec, cfg)
    Ts = horizons(spec, const, cfg)
    scale = noise_scale(spec)
    stds = tuple(
        scale * privacy.noisyhead_step_std(eta0=const.eta0, sigma=const.sigma, N=N, T=T, eps=eps, delta=delta,
                                           accountant=accountant)
        for T in Ts
    )
    Delta = privacy.step_sensitivity(eta0=const.eta0, sigma=const.sigma, N=N)
    spent = [privacy.spent_epsilon(multiplier=s / Delta, T=T, delta=delta) for s, T in zip(stds, Ts)]
    return Ts, stds, spent


def fit(problem, const, cfg, spec=None, stream: str = "") -> Fit:
    """``stream`` names the random streams of the start and the noise (a second, independent
    run on the same data uses another)."""
    B, N, D = problem.private.shape
    dtype, device = problem.private.q.dtype, problem.private.q.device
    eps, delta = float(cfg.privacy.eps), float(cfg.privacy.delta)
    accountant = accountant_of(spec, cfg)
    scale = noise_scale(spec)
    Ts, stds, spent = calibrate(spec, const, cfg, N)
    T_max = max(Ts)
    step = dict(lam=const.lam, eta0=const.eta0, radius=const.R)
    parts, trace = [], []
    for i, sl in chunks(B, cfg.compute.chunk_trials, "noisyhead"):
        gamma0 = initial_gamma(seed=cfg.seed, stream="init" + stream, trials=sl, D=D, scale=const.init_scale,
                               R=const.R, dtype=dtype, device=device)
        xi = rng.trial_normal(cfg.seed, "noise:noisyhead" + stream, sl, (T_max, D, D), dtype, device)
        quad = Quadratic(problem.private[sl])
        parts.append(run(quad, gamma0, T=Ts, noise_std=stds, noise=xi, **step))
        if i == 0:  # the training-loss curve of the first trial, longest horizon
            longest = max(range(len(stds)), key=Ts.__getitem__)
            trace = descend(quad.subset(torch.tensor([0], device=device)), gamma0[:1], T=(T_max,),
                            noise_std=(stds[longest],), noise=xi[:1], **step)[1]
    params = {
        "accountant": accountant,
        "horizon": getattr(spec, "horizon", "regime"),
        "T": ",".join(str(T) for T in Ts),
        "sigma": const.sigma,
        "step_sensitivity": privacy.step_sensitivity(eta0=const.eta0, sigma=const.sigma, N=N),
        "noise_std": ",".join(f"{s:.6g}" for s in stds),
        "spent_eps": ",".join(f"{e:.6g}" for e in spent),  # the eps at delta this noise buys
    }
    if accountant == "basic":
        params |= {"step_eps": ",".join(f"{eps / T:.6g}" for T in Ts),
                   "step_delta": ",".join(f"{delta / T:.6g}" for T in Ts)}
    if scale != 1:
        params["noise_scale"] = scale
    return Fit(gamma=torch.cat(parts), private=True, params=params, trace=trace, T=Ts)
