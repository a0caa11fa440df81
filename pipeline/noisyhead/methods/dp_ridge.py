"""Output-perturbed ridge (appendix B): the ridge solution on the private view plus Gaussian noise.

Gamma_dagger = (mu N I + sum_k vec(Z~_k) vec(Z~_k)^T)^{-1} sum_k clip_C(y_k) vec(Z~_k) on the clipped,
projected features NoisyHead uses, plus W ~ N(0, s^2 I). The penalty mu is the oracle's
(``ridge.penalty``: 2 lam with ``oracle=update``, the printed lam with ``oracle=printed``), so that
without noise the estimate is the oracle's on the private view; both sensitivities below are
evaluated at the mu actually used.

The method's ``calibration`` setting picks s:
- ``analytic``: the analytic Gaussian mechanism (``privacy.gaussian_multiplier``) on the sensitivity
  proven in ``privacy.ridge_sensitivity``; (eps, delta)-DP for any eps > 0, and the least noise
  that the sensitivity allows.
- ``classic``: the classic Gaussian mechanism on the same sensitivity; (eps, delta)-DP for eps < 1.
- ``paper``: the printed variance C^2 G^2 log(1.25/delta) / (lam^2 N^2 eps^2)
  (``privacy.ridge_std_printed``), kept to reproduce Table 1; it is not a proven guarantee.
"""

from __future__ import annotations

from pipeline import lazy, privacy, rng
from pipeline.noisyhead.methods import ridge
from pipeline.noisyhead.methods.base import Fit, chunks, noise_scale

torch = lazy.module("torch")  # imported at first use: the config's checks load this module (pipeline/lazy.py)

PRIVATE = True
ITERATIVE = False  # a direct solve, no steps
CALIBRATIONS = ("analytic", "classic", "paper")


def check(spec, cfg, const) -> str | None:
    """What in the config this estimator cannot honour, or None."""
    if spec.calibration not in CALIBRATIONS:
        return f"calibration must be one of {list(CALIBRATIONS)}, got {spec.calibration!r}"
    if spec.calibration == "classic" and not cfg.privacy.eps < 1:
        return f"the classic Gaussian mechanism needs privacy.eps < 1, got {cfg.privacy.eps}"
    return None


def sensitivity(spec, const, mu: float) -> float:
    bound = privacy.ridge_sensitivity_printed if spec.calibration == "paper" else privacy.ridge_sensitivity
    return bound(C=const.C, G=const.G, lam=mu, N=const.N)


def noise_std(spec, const, mu: float, *, eps: float, delta: float) -> float:
    """The calibrated std times the spec's ``noise_scale`` (1 unless deliberately under-noised)."""
    scale = noise_scale(spec)
    if spec.calibration == "paper":
        return scale * privacy.ridge_std_printed(C=const.C, G=const.G, lam=mu, N=const.N, eps=eps, delta=delta)
    Delta = sensitivity(spec, const, mu)
    if spec.calibration == "classic":
        return scale * privacy.gaussian_std(sensitivity=Delta, eps=eps, delta=delta)
    return scale * Delta * privacy.gaussian_multiplier(eps=eps, delta=delta)


def fit(problem, const, cfg, spec, stream: str = "") -> Fit:
    eps, delta = float(cfg.privacy.eps), float(cfg.privacy.delta)
    mu = ridge.penalty(const.lam, cfg.oracle)
    std = noise_std(spec, const, mu, eps=eps, delta=delta)
    parts = []
    for i, sl in chunks(problem.trials, cfg.compute.chunk_trials, spec.estimator):
        gamma = ridge.solve(problem.private[sl], mu)
        noise = rng.trial_normal(cfg.seed, f"noise:{spec.calibration}-ridge{stream}", sl, gamma.shape[1:], gamma.dtype,
                                 gamma.device)
        parts.append(gamma + std * noise)
    proven = privacy.ridge_sensitivity(C=const.C, G=const.G, lam=mu, N=const.N)
    params = {"calibration": spec.calibration, "penalty": mu, "sensitivity": sensitivity(spec, const, mu),
              "noise_std": f"{std:.6g}",
              # the eps this noise buys on the proven sensitivity (above the claim for calibration=paper)
              "spent_eps": f"{privacy.spent_epsilon(multiplier=std / proven, T=1, delta=delta):.6g}"}
    return Fit(gamma=torch.cat(parts).unsqueeze(1), private=True, params=params)
