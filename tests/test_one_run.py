"""The one-run audit's bounds (``pipeline/audit/one_run.py``: Steinke, Nasr and Jagielski's binomial
bound, Mahloujifar, Melis and Chaudhuri's f-DP bound): against a reference implementation's
numbers (``tests/data/one_run_reference.json``: jax_privacy's ``auditing.py``, computed once, its
commit recorded), against randomized-response canaries whose true eps is known exactly, and against
Gaussian canaries of known mu."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from scipy import optimize
from scipy.stats import binom

from pipeline import privacy
from pipeline.audit import one_run

REFERENCE = json.loads((Path(__file__).parent / "data" / "one_run_reference.json").read_text())


@pytest.mark.parametrize("row", REFERENCE["counts"], ids=lambda r: f"m{r['m']}-k{r['k']}-v{r['v']}-a{r['alpha']}-d{r['delta']}")
def test_the_bounds_from_counts_equal_the_reference(row):
    got = one_run.one_run_eps(row["m"], row["k"], row["v"], delta=row["delta"], alpha=row["alpha"])
    assert got == pytest.approx(row["binomial"], abs=1e-5)
    if "fdp" in row:
        got = one_run.one_run_eps(row["m"], row["k"], row["v"], delta=row["delta"], alpha=row["alpha"], bound="gaussian")
        assert got == pytest.approx(row["fdp"], abs=1e-5)


@pytest.mark.parametrize("row", REFERENCE["scores"], ids=lambda r: f"mu{r['mu']}")
def test_the_bounds_from_scores_equal_the_reference(row):
    """The reference guesses "in" for every score at or above its threshold (one-sided): the same
    guesses as the top k with k that count."""
    scores, included = np.array(row["scores"]), np.array(row["included"])
    k = int(np.sum(scores >= row["threshold"]))
    for bound, key in (("binomial", "binomial"), ("gaussian", "fdp")):
        got = one_run.one_run_bound(scores, included, delta=row["delta"], confidence=1 - row["significance"],
                                     guesses=(k,), sides="one", bound=bound)
        assert got.eps_lower == pytest.approx(row[key], abs=1e-5), bound
        assert got.k_plus == k and got.k_minus == 0 and got.eps_lower <= got.eps_ceiling


def test_the_ceilings_the_issue_quotes():
    """Every guess right on all m canaries, eps = 8, delta = 1e-5, 95%: about 5.8 at m = 1,000 and
    7.3 at m = 5,000, whatever the claim (the claim does not enter the ceiling)."""
    assert one_run.one_run_ceiling(1000, delta=1e-5) == pytest.approx(5.78, abs=0.01)
    assert one_run.one_run_ceiling(5000, delta=1e-5) == pytest.approx(7.28, abs=0.01)
    # trying more guess counts costs level: each is tested at 0.05 / 3
    assert one_run.one_run_ceiling(1000, delta=1e-5, guesses=(100, 500, 1000)) < one_run.one_run_ceiling(1000, delta=1e-5)


def _smallest_rejecting(m: int, k: int, eps: float, alpha: float, bound: str = "binomial") -> int:
    """The fewest correct guesses of k whose bound exceeds eps (k + 1 if none): the bound grows with v."""
    lo, hi = 0, k + 1
    while lo < hi:
        mid = (lo + hi) // 2
        if one_run.one_run_eps(m, k, mid, delta=0.0 if bound == "binomial" else 1e-5, alpha=alpha, bound=bound) > eps:
            hi = mid
        else:
            lo = mid + 1
    return lo


def test_randomized_response_canaries_are_bounded_at_their_true_eps_and_no_higher():
    """Each canary's score is its inclusion bit told truthfully with probability e^eps / (1 + e^eps)
    (randomized response: exactly eps-DP per canary, delta = 0). The binomial bound is exact for it:
    a bound above the true eps must be as rare as the level allows and no rarer than the
    discreteness of the binomial forces; Monte Carlo over 20,000 audits of the whole path (scores,
    guesses, counts) agrees with the binomial tail."""
    eps, m, alpha = 1.0, 400, 0.05
    v_star = _smallest_rejecting(m, m, eps, alpha)
    exact = float(binom.sf(v_star - 1, m, math.exp(eps) / (1 + math.exp(eps))))
    assert exact <= alpha and exact > alpha / 3  # valid, and tight up to the binomial's steps
    rng = np.random.default_rng(0)
    n = 20_000
    included = rng.random((n, m)) < 0.5
    truthful = rng.random((n, m)) < math.exp(eps) / (1 + math.exp(eps))
    scores = np.where(truthful == included, 1.0, -1.0) + 1e-3 * rng.random((n, m))  # ties broken at random
    correct = np.array([np.sum(one_run.guess(s, m // 2, m - m // 2) == np.where(i, 1, -1))
                        for s, i in zip(scores[:2000], included[:2000])])
    # guessing by the top half is not the same rule as guessing each sign, so check the sign rule's count too
    sign_correct = (truthful).sum(axis=1)
    rate = float(np.mean(sign_correct >= v_star))
    assert abs(rate - exact) < 4 * math.sqrt(exact * (1 - exact) / n) + 1e-4
    assert np.mean(correct >= v_star) <= alpha + 4 * math.sqrt(alpha * (1 - alpha) / 2000)
    # and a bound taken from the scores themselves never exceeds eps more often than that
    bounds = [one_run.one_run_bound(s, i, delta=0.0).eps_lower for s, i in zip(scores[:300], included[:300])]
    assert np.mean(np.array(bounds) > eps) <= alpha + 4 * math.sqrt(alpha * (1 - alpha) / 300)
    assert np.median(bounds) > 0.3 * eps  # and it is not vacuous


def _gdp_eps(mu: float, delta: float) -> float:
    return optimize.brentq(lambda e: privacy.gaussian_delta(mu=mu, eps=e) - delta, 0.0, 200.0)


def test_gaussian_canaries_the_f_dp_bound_is_valid_tighter_and_matches_its_power():
    """Scores N(mu, 1) if included, N(0, 1) if not: each canary's score is exactly mu-GDP, so a
    bound above the true eps(delta) of mu-GDP would be wrong. The f-DP bound (built for Gaussian
    trade-offs) is above the binomial one, and the power calculation (expected counts) is the
    median of simulated bounds."""
    m, mu, delta = 1000, 2.0, 1e-5
    truth = _gdp_eps(mu, delta)
    rng = np.random.default_rng(1)
    binomial, fdp = [], []
    for _ in range(15):
        included = rng.random(m) < 0.5
        scores = rng.normal(size=m) + mu * included
        binomial.append(one_run.one_run_bound(scores, included, delta=delta).eps_lower)
        fdp.append(one_run.one_run_bound(scores, included, delta=delta, bound="gaussian").eps_lower)
    assert max(binomial) < truth and max(fdp) < truth
    assert np.all(np.array(fdp) > np.array(binomial))
    for bound, found in (("binomial", binomial), ("gaussian", fdp)):
        power = one_run.one_run_power(m, truth, delta=delta, bound=bound)
        assert power == pytest.approx(float(np.median(found)), rel=0.1), bound


def test_a_strong_canary_reaches_the_ceiling_and_the_verdicts():
    """mu = 10: every guess is right (450 at each end: the included count varies about 500, so
    guessing all 1,000 would put a few at the wrong end), the bound is the ceiling; against a small
    claim that is a violation, against a claim above the ceiling it is too weak to say."""
    rng = np.random.default_rng(2)
    included = rng.random(1000) < 0.5
    scores = rng.normal(size=1000) + 10.0 * included
    result = one_run.one_run_bound(scores, included, delta=1e-5, guesses=(900,))
    assert result.correct == 900 and result.eps_lower == pytest.approx(result.eps_ceiling)
    power = one_run.one_run_power(1000, 16.0, delta=1e-5, guesses=(900,))
    assert one_run.one_run_verdict(result, 1.0, power) == "violation"
    assert one_run.one_run_verdict(result, 8.0, power).startswith(
        f"too weak to say (m = 1000 canaries prove at most {result.eps_ceiling:.3g}")
    quiet = one_run.one_run_bound(rng.normal(size=1000), included, delta=1e-5)  # canaries that leave no trace
    assert quiet.eps_lower < 1.0
    # a 2x violation of eps = 1 moves 1,000 canaries too little to be shown (mu about 0.4 at delta = 1e-5) ...
    weak = one_run.one_run_power(1000, 2.0, delta=1e-5)
    assert weak < 1.0 and one_run.one_run_verdict(quiet, 1.0, weak).startswith("too weak to say")
    # ... a 12x one can be: then a quiet audit is evidence
    assert one_run.one_run_verdict(quiet, 1.0, one_run.one_run_power(1000, 12.0, delta=1e-5)) == "consistent"


def test_guesses_and_refusals():
    scores = np.array([0.5, 3.0, -1.0, 2.0, 0.0])
    assert one_run.guess(scores, 2, 1).tolist() == [0, 1, -1, 1, 0]
    assert one_run.guess(np.zeros(4), 1, 1).tolist() == [-1, 0, 0, 1]  # ties by position, not by inclusion
    with pytest.raises(ValueError, match="0 <= v <= k <= m"):
        one_run.one_run_eps(10, 5, 6, delta=1e-5, alpha=0.05)
    with pytest.raises(ValueError, match="unknown one-run bound"):
        one_run.one_run_eps(10, 5, 5, delta=1e-5, alpha=0.05, bound="rdp")
    with pytest.raises(ValueError, match="one inclusion bit per score"):
        one_run.one_run_bound(scores, np.ones(4, bool), delta=1e-5)
    with pytest.raises(ValueError, match=r"guess count must lie in \[1, 5\]"):
        one_run.one_run_bound(scores, np.ones(5, bool), delta=1e-5, guesses=(6,))
    assert one_run.one_run_eps(10, 0, 0, delta=1e-5, alpha=0.05) == 0.0


def test_the_f_dp_value_is_no_bound_on_eps_for_a_non_gaussian_mechanism():
    """Randomized-response canaries exactly eps-DP (delta = 0 even): at the expected count of
    correct guesses the f-DP test rejects Gaussian claims well above eps, while the binomial bound
    stays below it. The f-DP value is therefore never reported as a bound on eps."""
    m, eps = 1000, 2.0
    v = int(round(m * math.exp(eps) / (1 + math.exp(eps))))
    assert one_run.one_run_eps(m, m, v, delta=1e-5, alpha=0.05, bound="gaussian") > 1.3 * eps
    assert one_run.one_run_eps(m, m, v, delta=1e-5, alpha=0.05) < eps
    with pytest.raises(ValueError, match="the f-DP estimate needs delta in"):
        one_run.one_run_eps(m, m, v, delta=0.0, alpha=0.05, bound="gaussian")


def test_power_from_the_audits_own_statistic():
    """Given mu, the power is that of N(mu, 1) against N(0, 1) scores; a smaller mu, less power."""
    strong = one_run.one_run_power(2000, delta=1e-5, mu=2.0)
    weak = one_run.one_run_power(2000, delta=1e-5, mu=0.5)
    assert strong > weak > 0
    assert one_run.one_run_power(2000, delta=1e-5, mu=1.0 / privacy.gaussian_multiplier(eps=4.0, delta=1e-5)) == \
        one_run.one_run_power(2000, 4.0, delta=1e-5)
    with pytest.raises(ValueError, match="needs eps_alt or mu"):
        one_run.one_run_power(2000, delta=1e-5)
