"""The one-run f-DP test against the accountant's own curve (``pipeline/audit/tradeoff.py``,
``pipeline.audit.one_run.fdp_test``): the curve is the mechanism's (never above its true power),
the p-value is valid where the truth is known (pure DP's binomial), honest runs are rejected at
most at the level over hundreds of simulated runs at the audit stages' and lm_finetune's settings,
and the negative controls the stages run are rejected."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import special
from scipy.stats import binom

from pipeline import privacy
from pipeline.audit import one_run, tradeoff
from pipeline.audit import run as run_audit


def test_the_gaussian_curve_is_the_mu_gdp_curve_and_never_above_it():
    mu = 1.0
    curve = tradeoff.gaussian(mu)
    x = np.logspace(-12, -0.01, 200)
    truth = special.ndtr(special.ndtri(x) + mu)  # 1 - f(x) of mu-GDP
    got = curve.g(x)
    assert np.all(got >= truth * (1 - 1e-9))  # conservative: a test of level x never reaches more than g(x)
    assert np.allclose(got, truth, rtol=0.05, atol=1e-6)
    y = np.logspace(-10, -0.05, 50)
    inv = np.array([curve.inverse(v) for v in y])
    exact = special.ndtr(special.ndtri(y) - mu)
    assert np.all(inv <= exact * (1 + 1e-9)) and np.allclose(inv, exact, rtol=0.05, atol=1e-8)
    assert curve.inverse(1.5) == math.inf and curve.inverse(0.0) == 0.0


def test_the_accountants_curve_has_the_accountants_eps():
    """The curve of the stage's plan (q 0.25, 100 steps, sigma for eps = 1) gives back eps 1 at delta
    1e-5 (Opacus' PRV accountant calibrated sigma; dp_accounting's PLD reads the same mechanism)."""
    sigma = privacy.dpsgd_noise_multiplier(eps=1.0, delta=1e-5, sample_rate=0.25, steps=100, accountant="prv")
    curve = tradeoff.curve(0.25, sigma, 100)
    assert curve.epsilon(1e-5) == pytest.approx(1.0, abs=0.02)
    assert tradeoff.curve(0.25, sigma / 2, 100).epsilon(1e-5) > 2.0
    # a larger sigma is a post-processing of a smaller one: its curve's power is nowhere larger
    x = np.logspace(-8, -0.3, 40)
    assert np.all(tradeoff.curve(0.25, sigma, 100).g(x) <= tradeoff.curve(0.25, sigma / 2, 100).g(x) + 1e-12)
    with pytest.raises(ValueError, match="sigma > 0"):
        tradeoff.curve(0.25, 0.0, 100)


@pytest.mark.parametrize("m,k,v", [(100, 100, 75), (1000, 100, 80), (1000, 1000, 760), (10_000, 1000, 750)])
def test_under_pure_dp_the_p_value_is_at_least_the_exact_binomial_tail(m, k, v):
    """Pure eps-DP: Steinke et al.'s theorem makes Binomial(k, e^eps / (1 + e^eps)) the worst law of
    the correct count, and it meets every constraint of ``fdp_mass`` with equality; the f-DP
    p-value, which assumes only the constraints, is at least its tail (valid) and within 2x of it."""
    eps = 1.0
    curve = tradeoff.from_profile([eps], [0.0])
    p = one_run.fdp_p_value(m, k, v, curve.inverse)
    tail = binom.sf(v - 1, k, special.expit(eps))
    assert tail <= p <= max(2 * tail, tail + 0.25)
    law = binom.pmf(np.arange(k + 1), k, special.expit(eps))
    w = np.arange(k + 1)
    for level in (1, v // 2, v):
        a = float(np.sum((w * law)[level:]))
        b = float(np.sum(((k - w) * law)[level - 1:]))
        assert a == pytest.approx(math.exp(eps) * b, rel=1e-9)  # A_w = m g(B_w / m) with g(x) = e^eps x


def test_the_gaussian_estimate_is_the_same_recursion_on_a_gaussian_curve():
    """The estimate's recursion (``one_run_eps(bound="gaussian")``) and ``fdp_mass`` on the mu-GDP
    curve agree on which claims v correct of k reject, away from the boundary."""
    m, k, alpha, delta = 1000, 1000, 0.05, 1e-5
    for v, eps in ((700, 0.5), (700, 2.0), (900, 2.0), (900, 4.0)):
        mu = 1.0 / privacy.gaussian_multiplier(eps=eps, delta=delta)
        estimate = one_run.one_run_eps(m, k, v, delta=delta, alpha=alpha, bound="gaussian")
        if abs(estimate - eps) < 0.2:
            continue
        rejected = one_run.fdp_mass(m, k, v, alpha, tradeoff.gaussian(mu).inverse) > 1
        assert rejected == (estimate > eps), (v, eps, estimate)


def _rr_scores(m: int, eps: float, rng) -> tuple[np.ndarray, np.ndarray]:
    """Randomized-response canaries: each reports its bit truthfully with probability
    e^eps / (1 + e^eps), plus a tie-breaking jitter that carries no information: exactly eps-DP."""
    bits = rng.random(m) < 0.5
    truthful = rng.random(m) < special.expit(eps)
    return np.where(truthful, bits, ~bits).astype(float) + 1e-3 * rng.random(m), bits


@pytest.mark.slow
def test_honest_runs_are_rejected_at_most_at_the_level():
    """At most alpha = 0.05 false rejections (binomial slack of three standard deviations) over 200
    honest runs each: the audit stages' plan (q 0.25, 100 steps) at eps 1 and 8, lm_finetune's shape
    (q 0.049, 80 steps, sigma 1.973), all scored by the per-step ratio, and randomized-response
    canaries exactly 1-DP against the 1-DP curve (where the GDP estimate reads 4.69)."""
    alpha, runs, m = 0.05, 200, 1000
    slack = alpha + 3 * math.sqrt(alpha * (1 - alpha) / runs)
    settings = [(0.25, privacy.dpsgd_noise_multiplier(eps=e, delta=1e-5, sample_rate=0.25, steps=100,
                                                       accountant="prv"), 100) for e in (1.0, 8.0)]
    settings.append((0.049, 1.973, 80))
    for q, sigma, steps in settings:
        rejected = 0
        for seed in range(runs):
            _, llr, bits = run_audit.simulate(m, q=q, sigma=sigma, steps=steps, seed=10_000 + seed)
            test = one_run.fdp_test(llr, bits, sample_rate=q, sigma=sigma, steps=steps, delta=1e-5,
                                    confidence=1 - alpha, guesses=run_audit.default_guesses(m), proved=False)
            rejected += test.rejected
        assert rejected / runs <= slack, (q, sigma, steps, rejected)
    rng = np.random.default_rng(0)
    pure = tradeoff.from_profile([1.0], [0.0])
    rejected = 0
    for _ in range(runs):
        scores, bits = _rr_scores(m, 1.0, rng)
        counts = one_run._counts(scores, bits, run_audit.default_guesses(m), "two")
        p = min(one_run.fdp_p_value(m, kp + km, v, pure.inverse) for kp, km, v in counts) * len(counts)
        rejected += p <= alpha
    assert rejected / runs <= slack


@pytest.mark.slow
def test_the_stages_controls_are_proved_and_an_honest_eps_8_run_proves_at_least_4():
    """The audit stages' plan (m = 10,000 canaries, q 0.25, 100 steps), canaries alone: at eps = 1 the
    halved noise, doubled sampling and the accountant's tenth are rejected (a proof that the run is
    not the accounted mechanism) and the honest run is not; at eps = 8 the honest run's proved eps
    is at least 4 and below the claim."""
    m, q, steps, delta = 10_000, 0.25, 100, 1e-5
    guesses = run_audit.default_guesses(m)
    sigma = privacy.dpsgd_noise_multiplier(eps=1.0, delta=delta, sample_rate=q, steps=steps, accountant="prv")
    tenth = privacy.dpsgd_noise_multiplier(eps=1.0, delta=delta, sample_rate=q, steps=10, accountant="prv")
    for name, (q_used, sigma_used) in {"engine": (q, sigma), "noise_halved": (q, sigma / 2),
                                       "sampling_doubled": (2 * q, sigma), "accountant_tenth": (q, tenth)}.items():
        _, llr, bits = run_audit.simulate(m, q=q_used, sigma=sigma_used, steps=steps, seed=3)
        test = one_run.fdp_test(llr, bits, sample_rate=q, sigma=sigma, steps=steps, delta=delta, guesses=guesses,
                                ceiling=False)
        assert test.rejected == (name != "engine"), (name, test)
        assert (test.eps_proved > 1.0) == (name != "engine"), (name, test)
    sigma8 = privacy.dpsgd_noise_multiplier(eps=8.0, delta=delta, sample_rate=q, steps=steps, accountant="prv")
    _, llr, bits = run_audit.simulate(m, q=q, sigma=sigma8, steps=steps, seed=3)
    test = one_run.fdp_test(llr, bits, sample_rate=q, sigma=sigma8, steps=steps, delta=delta, guesses=guesses)
    assert not test.rejected and 4.0 <= test.eps_proved < 8.0 < test.eps_ceiling


def test_a_perfect_separation_reaches_the_ceiling_and_nothing_is_proved_from_noise():
    rng = np.random.default_rng(5)
    bits = rng.random(2000) < 0.5
    kw = dict(sample_rate=0.25, sigma=2.0, steps=50, delta=1e-5, guesses=(200,))
    perfect = one_run.fdp_test(bits + 0.0, bits, **kw)
    assert perfect.rejected and perfect.eps_proved == pytest.approx(perfect.eps_ceiling)
    noise = one_run.fdp_test(rng.normal(size=2000), bits, **kw)
    assert not noise.rejected and noise.eps_proved == 0.0 and noise.p_value > 0.05
    with pytest.raises(ValueError, match="one inclusion bit per score"):
        one_run.fdp_test(np.zeros(3), np.zeros(4, bool), **kw)
    with pytest.raises(ValueError, match="0 <= v <= k <= m"):
        one_run.fdp_p_value(10, 5, 6, tradeoff.gaussian(1.0).inverse)
