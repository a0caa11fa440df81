"""Sensitivities and noise calibration of the private mechanisms.

Everything privacy-critical is here, stated as formulas with their source, so
that "where is the noise calibrated" has one answer. The noise itself is drawn
where the mechanism runs (``pipeline/noisyhead/methods/noisyhead.py``).

Neighbouring prompt sets differ in one prompt (replace-one, Definition 3.1).
"""

from __future__ import annotations

import functools
import math



def noisyhead_sensitivity(*, C: float, G: float, R: float) -> float:
    """sigma = 2 G (C + R G) (Theorem 3.2, proof A.2).

    One prompt contributes (<Gamma, Z~> - clip_C(y)) Z~ to the gradient sum, with
    ||Z~||_F <= G (projection), |<Gamma, Z~>| <= R G (||Gamma||_F <= R) and
    |clip_C(y)| <= C, so its norm is at most G (C + R G); replacing the prompt
    moves the sum by at most twice that. Scaled by eta0 / N it bounds the change
    of one update: ``step_sensitivity``.
    """
    return 2 * G * (C + R * G)


def step_sensitivity(*, eta0: float, sigma: float, N: int) -> float:
    """l2-sensitivity of one NoisyHead update before noise: eta0 sigma / N."""
    return eta0 * sigma / N


def gaussian_std(*, sensitivity: float, eps: float, delta: float) -> float:
    """Classic Gaussian mechanism (Dwork-Roth Thm A.1): (eps, delta)-DP for eps < 1 with
    std = sensitivity * sqrt(2 log(1.25 / delta)) / eps."""
    if not 0 < eps < 1:
        raise ValueError(f"the classic Gaussian mechanism needs 0 < eps < 1, got {eps}")
    if not 0 < delta < 1:
        raise ValueError(f"delta must lie in (0, 1), got {delta}")
    return sensitivity * math.sqrt(2 * math.log(1.25 / delta)) / eps


def noisyhead_step_std(*, eta0: float, sigma: float, N: int, T: int, eps: float, delta: float,
                       accountant: str = "basic") -> float:
    """Per-step noise std of Algorithm 1.

    ``basic`` (the paper): each of the T steps is the Gaussian mechanism at (eps / T, delta / T),
    so the T-fold composition is (eps, delta)-DP:
    s^2 = 2 eta0^2 T^2 sigma^2 log(1.25 T / delta) / (eps^2 N^2).
    ``tight``: T full-batch Gaussian steps of sensitivity Delta and std s compose to one
    Gaussian mechanism with noise multiplier s / (Delta sqrt(T)); s is the smallest for which
    that is (eps, delta)-DP (``tight_multiplier``).
    """
    Delta = step_sensitivity(eta0=eta0, sigma=sigma, N=N)
    if accountant == "tight":
        return Delta * tight_multiplier(T=T, eps=eps, delta=delta)
    return gaussian_std(sensitivity=Delta, eps=eps / T, delta=delta / T)


@functools.lru_cache(maxsize=256)
def tight_multiplier(*, T: int, eps: float, delta: float) -> float:
    """The per-step noise multiplier z (std / sensitivity) for which T composed Gaussian steps are
    (eps, delta)-DP. Their privacy loss is exactly that of one Gaussian mechanism with sensitivity
    sqrt(T) (independent Gaussian privacy losses add up to a Gaussian one), so z is dp-accounting's
    smallest Gaussian noise for T queries: the analytic Gaussian mechanism of Balle and Wang
    (exact, any eps > 0). The tests check it against dp-accounting's PLD accountant composing the
    T steps one by one, and against the exact delta(eps)."""
    from dp_accounting.pld import accountant, common  # imported when needed: a second to load

    return accountant.get_smallest_gaussian_noise(common.DifferentialPrivacyParameters(eps, delta),
                                                  num_queries=T, sensitivity=1.0)


def gaussian_multiplier(*, eps: float, delta: float) -> float:
    """The analytic Gaussian mechanism: the smallest noise multiplier for which one Gaussian release
    is (eps, delta)-DP, for any eps > 0."""
    return tight_multiplier(T=1, eps=eps, delta=delta)


@functools.lru_cache(maxsize=1024)  # a cell calibrates twice (checked, then fitted), a sweep's cells often alike
def spent_epsilon(*, multiplier: float, T: int, delta: float) -> float:
    """The eps, at delta, of T composed Gaussian steps with noise multiplier ``multiplier`` (one
    Gaussian with sensitivity sqrt(T)): dp-accounting's exact delta(eps) of that mechanism, inverted
    by its bisection (to 1e-9, rounded up). What a run actually spends."""
    if multiplier <= 0:  # no noise: no finite eps
        return math.inf
    from dp_accounting.pld import common, privacy_loss_mechanism

    loss = privacy_loss_mechanism.GaussianPrivacyLoss(multiplier, sensitivity=math.sqrt(T))
    search = common.BinarySearchParameters(0.0, 1e6, tolerance=1e-9)
    eps = common.inverse_monotone_function(loss.get_delta_for_epsilon, delta, search, increasing=False)
    return 0.0 if eps is None else eps


def gaussian_delta(*, mu: float, eps: float) -> float:
    """delta(eps) of a Gaussian mechanism with sensitivity / std = mu, exactly (Balle and Wang
    2018): Phi(-eps / mu + mu / 2) - e^eps Phi(-eps / mu - mu / 2). Used by the tests to check
    the accountant-based calibration independently."""
    from statistics import NormalDist

    Phi = NormalDist().cdf
    return Phi(-eps / mu + mu / 2) - math.exp(eps) * Phi(-eps / mu - mu / 2)


def ridge_sensitivity(*, C: float, G: float, lam: float, N: int) -> float:
    """l2-sensitivity of the output-perturbed ridge estimate (appendix B), proven here.

    Gamma = argmin F(Gamma), F = (1/2) sum_k (y_k - <Gamma, Z_k>)^2 + (lam N / 2) ||Gamma||^2,
    on features with ||Z_k||_F <= G and responses |y_k| <= C (clipped and projected).
    F is lam N-strongly convex. Let prompt i change (Z, y) -> (Z', y'), Gamma and Gamma' the
    two minimisers, l and l' the two versions of prompt i's loss, and F' the changed objective.
    Strong convexity of F at its minimiser Gamma gives
        lam N ||Gamma' - Gamma||^2 <= <grad F(Gamma'), Gamma' - Gamma>
                                    = <grad l(Gamma') - grad l'(Gamma'), Gamma' - Gamma>,
    since grad F'(Gamma') = 0. With grad l(Gamma) = (<Gamma, Z> - y) Z,
        ||Gamma - Gamma'|| <= (|<Gamma', Z> - y| ||Z|| + |<Gamma', Z'> - y'| ||Z'||) / (lam N)
                           <= 2 G (C + G ||Gamma'||) / (lam N).
    Any minimiser obeys ||Gamma|| <= C / sqrt(lam) (F(Gamma) <= F(0) = sum y^2 / 2 <= N C^2 / 2)
    and ||Gamma|| <= C G / lam (||sum y Z|| <= N C G, and the system matrix is >= lam N I).
    The bound is attained up to lower-order terms: one prompt (Z, C) against (-Z, C) with
    every other feature zero already moves Gamma by 2 C G / (lam N + G^2).
    """
    norm = min(C / math.sqrt(lam), C * G / lam)
    return 2 * G * (C + G * norm) / (lam * N)


def ridge_sensitivity_printed(*, C: float, G: float, lam: float, N: int) -> float:
    """The sensitivity appendix B asserts without proof, C G / (lam N). It is too small:
    see ``ridge_sensitivity``'s two-prompt example, which already moves Gamma by about twice it."""
    return C * G / (lam * N)


def ridge_std_printed(*, C: float, G: float, lam: float, N: int, eps: float, delta: float) -> float:
    """Appendix B's noise, exactly as printed: variance C^2 G^2 log(1.25/delta) / (lam^2 N^2 eps^2).
    Besides the sensitivity, it lacks the factor 2 under the logarithm of the classic Gaussian
    mechanism, so it is (eps, delta)-DP for neither sensitivity."""
    return ridge_sensitivity_printed(C=C, G=G, lam=lam, N=N) * math.sqrt(math.log(1.25 / delta)) / eps


def ssp_sensitivity(*, C: float, G: float) -> float:
    """l2-sensitivity of the sufficient statistics (sum_k z_k z_k^T, sum_k y_k z_k), released together,
    over z = vec(Z~) with ||z|| <= G and |y| <= C (clipped and projected), replace-one.

    Replacing prompt (z, y) by (z', y') changes the pair by (z z^T - z' z'^T, y z - y' z'), with
        ||z z^T - z' z'^T||_F^2 = |z|^4 + |z'|^4 - 2 (z.z')^2,
        ||y z - y' z'||^2 <= C^2 (|z|^2 + |z'|^2 + 2 |z.z'|)   (|y| = |y'| = C, signs against z.z').
    Both grow with |z| and |z'| (the constraint |z.z'| <= |z||z'| only loosens), so at the maximum
    |z| = |z'| = G; with p = |z.z'| in [0, G^2] the squared change is 2 G^4 - 2 p^2 + 2 C^2 (G^2 + p),
    a concave parabola with vertex p* = C^2 / 2. Hence
        Delta = 2 C G                             if C^2 >= 2 G^2   (p = G^2: z' = -z, y' = y),
        Delta^2 = 2 G^4 + 2 C^2 G^2 + C^4 / 2    otherwise          (z.z' = -C^2 / 2 with y' = y).
    Both cases are attained, so the bound is exact.
    """
    if C**2 >= 2 * G**2:
        return 2 * C * G
    return math.sqrt(2 * G**4 + 2 * C**2 * G**2 + C**4 / 2)


def dpsgd_noise_multiplier(*, eps: float, delta: float, sample_rate: float, steps: int, accountant: str) -> float:
    """DP-SGD: Opacus's accountant's smallest noise multiplier (to its tolerance) for which T steps of
    the Poisson-subsampled Gaussian mechanism at ``sample_rate`` meet (eps, delta).

    A pure function of its arguments, cached: Opacus's bisection (about 17 RDP evaluations at 150
    orders, most of them fractional, in Python) took 0.7-2.5 s a call on CI's cores, paid once when a
    sweep validates a cell and again when the cell runs, and once per cell of a tuning grid whose cells
    differ in a learning rate only; it was most of a CI-sized cell's time. The arguments are made plain
    floats, an int and a str first, so that equal keys are equal inputs (a float32 or a float step count
    would hash as its float64 twin)."""
    if int(steps) != steps:
        raise ValueError(f"steps must be a whole number, got {steps!r}")
    return _noise_multiplier(float(eps), float(delta), float(sample_rate), int(steps), str(accountant))


@functools.lru_cache(maxsize=1024)
def _noise_multiplier(eps: float, delta: float, sample_rate: float, steps: int, accountant: str) -> float:
    import warnings

    from opacus.accountants.utils import get_noise_multiplier

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return get_noise_multiplier(target_epsilon=eps, target_delta=delta, sample_rate=sample_rate,
                                    steps=steps, accountant=accountant)


def dpsgd_spent_epsilon(*, sigma: float, delta: float, sample_rate: float, steps: int, accountant: str) -> float:
    """DP-SGD: the eps Opacus's accountant reports for the run actually made (cached: a pure function of
    its arguments as plain floats, an int and a str)."""
    if int(steps) != steps:
        raise ValueError(f"steps must be a whole number, got {steps!r}")
    return _spent_epsilon(float(sigma), float(delta), float(sample_rate), int(steps), str(accountant))


@functools.lru_cache(maxsize=1024)
def _spent_epsilon(sigma: float, delta: float, sample_rate: float, steps: int, accountant: str) -> float:
    import warnings

    from opacus.accountants.utils import create_accountant

    acc = create_accountant(mechanism=accountant)
    acc.history = [(sigma, sample_rate, steps)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return acc.get_epsilon(delta=delta)


ACCOUNTANTS = ("basic", "tight")  # basic: each step at (eps/T, delta/T); tight: the exact composition
