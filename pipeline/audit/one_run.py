"""An audit of one training run (Steinke, Nasr and Jagielski, NeurIPS 2023, arXiv:2305.08846;
Mahloujifar, Melis and Chaudhuri, ICML 2025, arXiv:2410.22235). m canaries, each included in the
training independently with probability 1/2; after training each gets a score (higher: more likely
included). The auditor guesses "in" for the ``k_plus`` highest scores and "out" for the ``k_minus``
lowest, abstaining on the rest, and counts its correct guesses v among k = k_plus + k_minus.
Several guess counts may be tried (``guesses``): each is tested at (1 - confidence) / len(guesses)
(Bonferroni), so every statement stays valid whichever count wins.

Two proofs, each holding at the audit's confidence whatever the mechanism:

- **Steinke et al.'s bound** (``one_run_bound``, ``bound="binomial"``): under (eps, delta)-DP, v is
  stochastically below Binomial(k, e^eps / (1 + e^eps)) up to a term in 2 m delta (their Theorem
  5.2 and Proposition 5.7: ``one_run_p_value``); the bound is the largest eps whose p-value is at
  most 1 - confidence: a lower bound on the run's eps at delta. The largest m canaries can give is
  that of every guess right (``one_run_ceiling``): about 5.8 at m = 1,000 and 7.3 at m = 5,000 with
  k = m, delta = 1e-5 and 95% confidence.
- **The f-DP test against the accountant's own curve** (``fdp_test``): the claim is that the run
  is the mechanism its accountant composed, whose trade-off function f is
  ``pipeline.audit.tradeoff.curve(q, sigma, steps)``; under any f-DP mechanism the law of v obeys
  the constraints of ``fdp_mass``, which bound P[W >= v] (``fdp_p_value``). A p-value at most 1 -
  confidence proves the run is not that mechanism; ``eps_proved`` is the eps of the most private
  run of the same family (q, steps, any noise) the scores reject.

Two estimates, true only if the run's trade-off is Gaussian (DP-SGD's composed steps approach one
but need not meet it: randomized-response canaries exactly 1-DP get values above 1,
``tests/test_one_run.py``): ``bound="gaussian"`` (Mahloujifar et al.'s recursion over the Gaussian
trade-off of the mechanism exactly (eps, delta)-DP) and ``gdp_estimate`` (a Gaussian-DP mu from the
ROC curve, as jax_privacy's ``epsilon_from_gdp``). They are named estimates everywhere and never
make a violation.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from scipy import optimize, special
from scipy.stats import beta, binom, norm

from pipeline import privacy


# --- one training run ---------------------------------------------------------------------------

ONE_RUN_BOUNDS = ("binomial", "gaussian")  # a proof; an estimate (a Gaussian trade-off assumed)


def one_run_p_value(m: int, k: int, v: int, eps: float, delta: float) -> float:
    """Under (eps, delta)-DP, the probability of at least ``v`` correct among ``k`` guesses on ``m``
    canaries is at most this (Steinke et al., Theorem 5.2 with Proposition 5.7): with
    W ~ Binomial(k, e^eps / (1 + e^eps)), P[W >= v] + 2 m delta max_{1 <= i <= v} (P[W >= v - i] -
    P[W >= v]) / i."""
    if v <= 0:
        return 1.0
    q = float(special.expit(eps))
    tail = float(binom.sf(v - 1, k, q))
    if delta == 0:
        return tail
    i = np.arange(1, v + 1)
    alpha = float(np.max((binom.sf(v - i - 1, k, q) - tail) / i))
    return min(1.0, tail + 2 * m * delta * alpha)


def _largest_rejected(rejected, eps_hi: float = 1.0) -> float:
    """The largest eps >= 0 with ``rejected(eps) > 0`` (a decreasing function): 0 if none."""
    if rejected(0.0) <= 0:
        return 0.0
    lo, hi = 0.0, eps_hi
    while rejected(hi) > 0:
        if hi > 1e3:  # every claim up to 1,000 rejected: no noise at all
            return math.inf
        lo, hi = hi, 2 * hi
    return float(optimize.brentq(rejected, lo, hi, xtol=1e-6))


def _gaussian_tradeoff_inverse(eps: float, delta: float):
    """x -> Phi(Phi^-1(x) - mu) for the Gaussian mechanism exactly (eps, delta)-DP (mu = 1 / its
    noise multiplier): the inverse of the blow-up its trade-off function allows."""
    mu = 1.0 / privacy.gaussian_multiplier(eps=eps, delta=delta)
    return lambda x: float(special.ndtr(special.ndtri(x) - mu))


def _fdp_rejected(m: int, k: int, v: int, alpha: float, delta: float):
    """Mahloujifar et al.'s test of a Gaussian trade-off claim from v correct of k guesses on m
    canaries at level alpha: positive where the claim (eps, delta) is rejected. Starting from the
    shares of correct and wrong guesses that the level allows (r = alpha v / m, h = alpha (k - v) /
    m), the recursion raises h to the least the trade-off function permits given r, and r by the
    matching share, one correct guess at a time; the claim is rejected when the shares it can
    account for stay below k / m."""
    def rejected(eps: float) -> float:
        inverse = _gaussian_tradeoff_inverse(max(eps, 1e-9), delta)
        r, h = alpha * v / m, alpha * (k - v) / m
        for i in range(v - 1, -1, -1):
            raised = max(h, inverse(r))
            if raised == h:  # neither moves again
                break
            r, h = min(r + i / (k - i) * (raised - h), 1.0), raised
        return r + h - k / m
    return rejected


def one_run_eps(m: int, k: int, v: int, *, delta: float, alpha: float, bound: str = "binomial") -> float:
    """From ``v`` correct of ``k`` guesses on ``m`` canaries, at level ``alpha`` (probability of a
    wrong answer): the largest eps whose claim the outcome rejects; 0 where it rejects none.

    ``binomial``: the claim is (eps, delta)-DP, so this is a lower bound on the mechanism's eps.
    ``gaussian``: the claim is "as private as the Gaussian mechanism exactly (eps, delta)-DP" (a
    Gaussian trade-off function). That is a lower bound on eps only for mechanisms whose trade-off
    is Gaussian; subsampled DP-SGD's is not, and randomized-response canaries that are exactly
    eps-DP get values above eps (``tests/test_one_run.py``): an estimate, never a bound on eps."""
    if not 0 <= v <= k <= m:
        raise ValueError(f"need 0 <= v <= k <= m, got v={v}, k={k}, m={m}")
    if bound == "gaussian" and not 0 < delta < 1:
        raise ValueError(f"the f-DP estimate needs delta in (0, 1) (a Gaussian claim at delta = 0 is no DP claim), got {delta}")
    if k == 0 or v == 0:
        return 0.0
    if bound == "binomial":
        if one_run_p_value(m, k, v, 0.0, 0.0) > alpha:  # not even pure DP at eps = 0 is rejected
            return 0.0
        return _largest_rejected(lambda eps: alpha - one_run_p_value(m, k, v, eps, delta))
    if bound == "gaussian":
        return _largest_rejected(_fdp_rejected(m, k, v, alpha, delta))
    raise ValueError(f"unknown one-run bound {bound!r}; known: {ONE_RUN_BOUNDS}")


def one_run_ceiling(m: int, *, delta: float, confidence: float = 0.95, guesses: tuple[int, ...] | None = None,
                    bound: str = "binomial") -> float:
    """The largest bound ``m`` canaries can give with these guess counts (default: all m): every
    guess right, at the Bonferroni-corrected level."""
    guesses = tuple(guesses or (m,))
    alpha = (1 - confidence) / len(guesses)
    return max(one_run_eps(m, k, k, delta=delta, alpha=alpha, bound=bound) for k in guesses)


@dataclass(frozen=True)
class OneRun:
    bound: str  # "binomial" (Steinke et al.: a proof) or "gaussian" (Mahloujifar et al.'s recursion, a Gaussian trade-off assumed: an estimate)
    eps_lower: float  # binomial: the lower bound on eps at the audit's confidence; gaussian: the largest Gaussian claim rejected (an estimate, no bound on eps)
    m: int  # canaries
    k_plus: int  # guesses "in" (highest scores)
    k_minus: int  # guesses "out" (lowest scores)
    correct: int  # correct guesses among k_plus + k_minus
    eps_ceiling: float  # the bound of every guess right, same guess counts and level
    candidates: int  # guess counts tried (the level is divided by it)


def guess(scores: np.ndarray, k_plus: int, k_minus: int) -> np.ndarray:
    """+1 ("in") for the ``k_plus`` highest scores, -1 for the ``k_minus`` lowest, 0 (abstain)
    elsewhere. Ties are broken by position (a stable sort), never by inclusion."""
    order = np.argsort(scores, kind="stable")
    out = np.zeros(scores.size, dtype=np.int8)
    if k_minus:
        out[order[:k_minus]] = -1
    if k_plus:
        out[order[scores.size - k_plus:]] = 1
    return out


def one_run_bound(scores: np.ndarray, included: np.ndarray, *, delta: float, confidence: float = 0.95,
                  guesses: tuple[int, ...] | None = None, sides: str = "two", bound: str = "binomial") -> OneRun:
    """The one-run lower bound on eps from the canaries' ``scores`` and their inclusion bits
    (``included``, drawn before training and read only here). Each count k of ``guesses`` (default:
    every canary) is split between the two ends (``sides="two"``: k_plus = ceil(k / 2), k_minus the
    rest; ``"one"``: k_plus = k) and tested at (1 - confidence) / len(guesses); the best is kept."""
    scores, included = np.asarray(scores, dtype=np.float64), np.asarray(included, dtype=bool)
    m = scores.size
    if included.shape != scores.shape or m == 0:
        raise ValueError(f"need one inclusion bit per score, got {included.shape} and {scores.shape}")
    if sides not in ("one", "two"):
        raise ValueError(f"sides must be 'one' or 'two', got {sides!r}")
    guesses = tuple(int(k) for k in (guesses or (m,)))
    if any(not 0 < k <= m for k in guesses):
        raise ValueError(f"every guess count must lie in [1, {m}], got {guesses}")
    alpha = (1 - confidence) / len(guesses)
    best = None
    for k_plus, k_minus, v in _counts(scores, included, guesses, sides):
        eps = one_run_eps(m, k_plus + k_minus, v, delta=delta, alpha=alpha, bound=bound)
        if best is None or eps > best[0]:
            best = (eps, k_plus, k_minus, v)
    eps, k_plus, k_minus, v = best
    return OneRun(bound=bound, eps_lower=eps, m=m, k_plus=k_plus, k_minus=k_minus, correct=v,
                  eps_ceiling=one_run_ceiling(m, delta=delta, confidence=confidence, guesses=guesses, bound=bound),
                  candidates=len(guesses))


def one_run_power(m: int, eps_alt: float | None = None, *, delta: float, confidence: float = 0.95,
                  guesses: tuple[int, ...] | None = None, sides: str = "two", bound: str = "binomial",
                  mu: float | None = None) -> float:
    """The bound the audit reaches, at expected counts, when each canary's score is N(mu, 1) if
    included and N(0, 1) if not: how large a violation m canaries can show at all. Give the
    audit's own ``mu`` where its statistic is known (a DP-SGD run's Dirac canaries: the plan's
    q sqrt(T) / sqrt(sigma^2 + q (1 - q)) at the alternative's sigma); with ``eps_alt`` alone, mu
    is that of the Gaussian mechanism exactly (eps_alt, delta)-DP, the strongest canary such a
    mechanism allows (a white-box canary in a single Gaussian release), which overstates the
    power of an audit whose statistic sees less (a subsampled run's sum score)."""
    if mu is None:
        if eps_alt is None:
            raise ValueError("one_run_power needs eps_alt or mu")
        mu = 1.0 / privacy.gaussian_multiplier(eps=eps_alt, delta=delta)
    guesses = tuple(int(k) for k in (guesses or (m,)))
    alpha = (1 - confidence) / len(guesses)
    best = 0.0
    for k in guesses:
        k_plus = k if sides == "one" else (k + 1) // 2
        k_minus = k - k_plus
        right = 0.0
        if k_plus:  # threshold t with the expected count above it k_plus: m/2 (sf(t - mu) + sf(t)) = k_plus
            t = optimize.brentq(lambda t: m / 2 * (norm.sf(t - mu) + norm.sf(t)) - k_plus, -40, 40 + mu)
            right += m / 2 * norm.sf(t - mu)
        if k_minus:
            t = optimize.brentq(lambda t: m / 2 * (norm.cdf(t - mu) + norm.cdf(t)) - k_minus, -40, 40 + mu)
            right += m / 2 * norm.cdf(t)
        best = max(best, one_run_eps(m, k, int(round(right)), delta=delta, alpha=alpha, bound=bound))
    return best


def one_run_verdict(result: OneRun, claimed_eps: float, power: float) -> str:
    """``violation`` (the bound exceeds the claim: a proof at the audit's confidence, for the
    binomial bound), ``consistent`` (no violation, and one of ``power``'s size could have been
    shown), or ``too weak to say (...)`` (the ceiling or the power does not reach the claim)."""
    if result.eps_lower > claimed_eps:
        return "violation"
    if result.eps_ceiling <= claimed_eps or power <= claimed_eps:
        return (f"too weak to say (m = {result.m} canaries prove at most {result.eps_ceiling:.3g}; "
                f"a clear violation would give {power:.3g})")
    return "consistent"


# --- the f-DP test against the accountant's own curve (a proof) ---------------------------------

def fdp_mass(m: int, k: int, v: int, p: float, inverse) -> float:
    """The least total probability a law of the correct-guess count W can have if P[W >= v] >= p
    and the mechanism is f-DP towards each canary, with ``inverse`` the inverse of g = 1 - f
    (``pipeline.audit.tradeoff.Curve.inverse``). More than 1: no such law, so P[W >= v] < p.

    The constraints (derived in docs/audit.md, "The f-DP test"; Mahloujifar, Melis and Chaudhuri's
    Theorem): for every canary j, fixing the others' bits, the event "j guessed in and the other
    guesses hold at least w - 1 correct" is a test between j included and excluded, so its power
    is at most g of its level (and the same for "guessed out", f being symmetric); averaging over
    the canaries and the other bits (g concave) gives, for every w = 1..k,

        A_w = E[W 1{W >= w}] <= m g(B_w / m),   B_w = E[(k - W) 1{W >= w - 1}].

    The least mass puts p at exactly v (mass above v only raises every A and B) and, going down,
    at each level i < v the least mass r_i that lifts B to g^-1(A / m) m; once B already suffices,
    no level below needs any (the remaining constraints are the same one). Exact for Binomial(k,
    e^eps / (1 + e^eps)) under eps-DP, which meets every constraint with equality."""
    a, b, mass = p * v / m, p * (k - v) / m, p  # A and B over m
    for i in range(v - 1, -1, -1):
        need = inverse(a)
        if need <= b:
            break
        r = (need - b) * m / (k - i)
        mass += r
        if mass > 1:
            return mass
        a, b = a + i * r / m, need
    return mass


def fdp_p_value(m: int, k: int, v: int, inverse, tol: float = 1e-4) -> float:
    """Under f-DP (``inverse`` of g = 1 - f), an upper bound on P[W >= v] for v correct of k
    guesses on m canaries: the largest p whose least mass (``fdp_mass``) is at most 1, found by
    bisection and rounded up by ``tol`` (relative): a valid p-value."""
    if not 0 <= v <= k <= m:
        raise ValueError(f"need 0 <= v <= k <= m, got v={v}, k={k}, m={m}")
    if v == 0 or fdp_mass(m, k, v, 1.0, inverse) <= 1:
        return 1.0
    lo, hi = 0.0, 1.0  # mass(lo) <= 1 < mass(hi)
    while hi - lo > tol * hi:
        mid = (lo + hi) / 2
        if fdp_mass(m, k, v, mid, inverse) <= 1:
            lo = mid
        else:
            hi = mid
    return hi


@dataclass(frozen=True)
class FDPTest:
    """The one-run f-DP test of a run's canary scores against its accountant's curve."""
    p_value: float  # P[this many correct or more] under the accounted mechanism, Bonferroni over the guess counts
    rejected: bool  # p_value <= 1 - confidence: a proof that the run is not the accounted mechanism
    eps_proved: float  # the largest eps' whose re-noised mechanism (same q and steps) the scores reject: a proof
    eps_ceiling: float  # the largest eps' m canaries could reject (every guess right)
    m: int
    k_plus: int
    k_minus: int
    correct: int
    candidates: int  # guess counts tried


SIGMA_RANGE = (0.2, 100.0)  # the family's noise multipliers searched for eps_proved (below 0.2: reported as 0.2's eps, a valid lower bound)


def _counts(scores: np.ndarray, included: np.ndarray, guesses: tuple[int, ...], sides: str) -> list[tuple[int, int, int]]:
    """(k_plus, k_minus, correct) for each guess count (``sides``: "two" splits k between the ends, "one" guesses in only)."""
    truth = np.where(included, 1, -1)
    out = []
    for k in guesses:
        k_plus = k if sides == "one" else (k + 1) // 2
        out.append((k_plus, k - k_plus, int(np.sum(guess(scores, k_plus, k - k_plus) == truth))))
    return out


def _largest_eps_rejected(m: int, counts: list[tuple[int, int, int]], alpha: float, sample_rate: float, steps: int,
                          delta: float, steps_of_search: int = 14) -> float:
    """The eps at ``delta`` of the most private member (largest sigma) of the accounted family (same
    q and steps, noise multiplier sigma') whose curve some guess count rejects at ``alpha``: rejection
    is monotone in sigma' (a run with a larger sigma' is a post-processing of one with a smaller), so
    bisection on log sigma' finds the boundary, and the eps of its rejected side is returned (at most
    that of ``SIGMA_RANGE``'s smallest sigma'); 0 where no member is rejected."""
    from pipeline.audit import tradeoff

    def rejected(sigma: float) -> bool:
        inverse = tradeoff.curve(sample_rate, sigma, steps).inverse
        return any(fdp_mass(m, kp + km, v, alpha, inverse) > 1 for kp, km, v in counts if v)

    lo, hi = math.log(SIGMA_RANGE[0]), math.log(SIGMA_RANGE[1])  # rejected(e^hi) is the easiest claim
    if not rejected(math.exp(hi)):
        return 0.0
    if rejected(math.exp(lo)):
        return tradeoff.curve(sample_rate, math.exp(lo), steps).epsilon(delta)
    for _ in range(steps_of_search):  # rejected(e^hi) and not rejected(e^lo)
        mid = (lo + hi) / 2
        if rejected(math.exp(mid)):
            hi = mid
        else:
            lo = mid
    return tradeoff.curve(sample_rate, math.exp(hi), steps).epsilon(delta)


@functools.lru_cache(maxsize=16)
def _ceiling(m: int, perfect: tuple, alpha: float, sample_rate: float, steps: int, delta: float) -> float:
    """``_largest_eps_rejected`` for every guess right: the same for every row of a stage (once per process)."""
    return _largest_eps_rejected(m, list(perfect), alpha, sample_rate, steps, delta)


def fdp_test(scores: np.ndarray, included: np.ndarray, *, sample_rate: float, sigma: float, steps: int, delta: float,
             confidence: float = 0.95, guesses: tuple[int, ...] | None = None, sides: str = "two",
             proved: bool = True, ceiling: bool = True) -> FDPTest:
    """Test a run's canary ``scores`` (with their inclusion bits) against the curve of the mechanism
    its accountant composed (``pipeline.audit.tradeoff.curve(sample_rate, sigma, steps)``): the
    p-value of the best guess count, times the number tried (Bonferroni). A rejection proves, at
    ``confidence``, that the run is not that mechanism; an honest run is rejected with probability at
    most 1 - confidence, whatever its data. ``eps_proved`` is the eps at ``delta`` of the most private
    run of the same family (q, steps, any sigma') the scores reject, and ``eps_ceiling`` the same for
    every guess right (``proved=False`` skips both searches, ``ceiling=False`` the second)."""
    from pipeline.audit import tradeoff

    scores, included = np.asarray(scores, dtype=np.float64), np.asarray(included, dtype=bool)
    m = scores.size
    if included.shape != scores.shape or m == 0:
        raise ValueError(f"need one inclusion bit per score, got {included.shape} and {scores.shape}")
    guesses = tuple(int(k) for k in (guesses or (m,)))
    if any(not 0 < k <= m for k in guesses):
        raise ValueError(f"every guess count must lie in [1, {m}], got {guesses}")
    alpha = (1 - confidence) / len(guesses)
    counts = _counts(scores, included, guesses, sides)
    inverse = tradeoff.curve(sample_rate, sigma, steps).inverse
    ps = [fdp_p_value(m, kp + km, v, inverse) for kp, km, v in counts]
    best = int(np.argmin(ps))
    p = min(1.0, ps[best] * len(guesses))
    nan = float("nan")
    eps = _largest_eps_rejected(m, counts, alpha, sample_rate, steps, delta) if proved else nan
    perfect = tuple((kp, km, kp + km) for kp, km, _ in counts)
    top = _ceiling(m, perfect, alpha, float(sample_rate), int(steps), float(delta)) if proved and ceiling else nan
    kp, km, v = counts[best]
    return FDPTest(p_value=p, rejected=p <= 1 - confidence, eps_proved=eps, eps_ceiling=top, m=m, k_plus=kp,
                   k_minus=km, correct=v, candidates=len(guesses))


# --- Gaussian differential privacy -------------------------------------------------------------

def gdp_epsilon(mu: float, delta: float) -> float:
    """The eps at ``delta`` of a mu-GDP mechanism (Dong, Roth and Su, Corollary 2.13): the eps with
    Phi(-eps / mu + mu / 2) - e^eps Phi(-eps / mu - mu / 2) = delta, in the log domain; 0 where mu
    <= 0 (no separation: nothing is shown, whichever way the scores lean) or where delta(0) <= delta."""
    if not 0 < delta < 1:
        raise ValueError(f"delta must lie in (0, 1), got {delta!r}")
    if not mu > 0:
        return 0.0
    if math.isinf(mu):
        return math.inf

    def gap(eps: float) -> float:
        a = norm.logcdf(-eps / mu + mu / 2)
        b = eps + norm.logcdf(-eps / mu - mu / 2)
        if b >= a:
            return -math.inf
        return a + math.log1p(-math.exp(b - a)) - math.log(delta)

    if gap(0.0) <= 0:
        return 0.0
    hi = 1.0
    while gap(hi) > 0:
        hi *= 2
        if hi > 1e6:
            return math.inf
    return float(optimize.brentq(gap, 0.0, hi, xtol=1e-9))


def _upper_hull(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Indices of the vertices of the upper concave hull of the points (x, y) sorted by x: the
    thresholds no randomised mixture of two others dominates (collinear points dropped)."""
    hull: list[int] = []
    for i in range(x.size):
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            if (y[b] - y[a]) * (x[i] - x[b]) - (y[i] - y[b]) * (x[b] - x[a]) <= 0:
                hull.pop()
            else:
                break
        hull.append(i)
    return np.asarray(hull)


@dataclass(frozen=True)
class GDP:
    """An estimate under a Gaussian trade-off, never a bound: see ``gdp_estimate``."""
    mu: float  # the largest mu the scores show at the audit's confidence, were the trade-off Gaussian (0: none)
    eps: float  # its eps at the run's delta (``gdp_epsilon``)
    thresholds: int  # thresholds tested (the Bonferroni count is twice this)
    eps_ceiling: float  # the same for perfectly separated scores of these sizes


def _gdp_mu(in_sorted: np.ndarray, out_sorted: np.ndarray, significance: float, delta: float) -> tuple[float, int]:
    thresholds = np.concatenate([np.union1d(in_sorted, out_sorted), [np.inf]])
    fn = np.searchsorted(in_sorted, thresholds, side="left")  # "in" guessed at s >= t: misses below t
    tn = np.searchsorted(out_sorted, thresholds, side="left")
    keep = _upper_hull(fn.astype(float), tn.astype(float))
    fn, tn, n = fn[keep], tn[keep], keep.size
    n_in, n_out = in_sorted.size, out_sorted.size
    level = significance / (2 * n)

    def upper(k, total):  # one-sided Clopper-Pearson upper bound, failing with probability level
        return np.where(k < total, beta.ppf(1 - level, k + 1, np.maximum(total - k, 1)), 1.0)

    fnr, fpr = upper(fn, n_in), upper(n_out - tn, n_out)
    usable = np.maximum(fnr, fpr) < 1 - delta
    if not usable.any():
        return 0.0, n
    mu = norm.isf(fpr[usable]) - norm.ppf(fnr[usable])  # mu-GDP: FNR >= Phi(Phi^-1(1 - FPR) - mu)
    return max(0.0, float(np.max(mu))), n


def gdp_estimate(scores: np.ndarray, included: np.ndarray, *, delta: float, confidence: float = 0.95) -> GDP:
    """A Gaussian-DP estimate from the canaries' scores (Andrew et al. 2024, arXiv:2302.07956;
    Nasr et al. 2023): at every threshold t of the ROC curve's upper hull (higher scores guessed
    "in"), one-sided Clopper-Pearson upper bounds on the false negative and false positive rates,
    Bonferroni-corrected over the 2 n bounds, give mu >= Phi^-1(1 - FPR) - Phi^-1(FNR) under mu-GDP;
    the largest such mu, and its eps at ``delta``. The canaries are taken as independent trials and
    the trade-off as Gaussian: an estimate for a Gaussian-like mechanism (DP-SGD's composition of
    many subsampled steps), never a proof that the run breaks (eps, delta)-DP.
    Scores that lean the wrong way (included lower) show mu = 0, not a negative mu taken at its
    absolute value."""
    scores, included = np.asarray(scores, dtype=np.float64), np.asarray(included, dtype=bool)
    if included.shape != scores.shape or included.all() or not included.any():
        raise ValueError("the GDP estimate needs included and excluded canaries, one inclusion bit per score")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence!r}")
    a, b = np.sort(scores[included]), np.sort(scores[~included])
    mu, n = _gdp_mu(a, b, 1 - confidence, delta)
    ceiling, _ = _gdp_mu(np.ones(a.size), np.zeros(b.size), 1 - confidence, delta)
    return GDP(mu=mu, eps=gdp_epsilon(mu, delta), thresholds=n, eps_ceiling=gdp_epsilon(ceiling, delta))
