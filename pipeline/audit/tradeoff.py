"""The trade-off curve of the mechanism a DP-SGD run's accountant composed, for the one-run f-DP
test (``pipeline.audit.one_run.fdp_p_value``): the null hypothesis a rigorous audit tests.

The accountant's claim is that the training is the Poisson-subsampled Gaussian mechanism (sampling
rate q, noise multiplier sigma, T steps, add-or-remove one example), adaptively composed. Its
privacy profile delta(eps) for every eps >= 0 is read from dp_accounting's privacy loss
distribution of that mechanism, pessimistically discretised (``pessimistic_estimate=True``: every
delta it gives is at least the true one), the larger of the add and remove directions. A mechanism
that is (eps, delta(eps))-DP for every eps is f-DP for the symmetric convex trade-off function

    f(x) = sup_eps max(0, 1 - delta(eps) - e^eps x, e^-eps (1 - delta(eps) - x))

(Dong, Roth and Su, Proposition 2.12 and the duality of privacy profiles and trade-off functions),
and this module works with g = 1 - f, the largest probability a test of level x can reach:

    g(x) = min(1, min_eps delta(eps) + e^eps x, min_eps 1 - e^-eps (1 - delta(eps) - x)),

taken over a finite grid of eps (a supremum over fewer eps: a smaller f, a larger g, so every test
built on it stays valid, only slightly less sharp). ``inverse`` is g's generalised inverse,
inf{x >= 0: g(x) >= y}, read on a fine grid of y at the grid point at or below y (a smaller value:
again conservative).
"""

from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass

import numpy as np

DISCRETISATION = 1e-4  # dp_accounting's value_discretization_interval for the privacy loss, times max(1, sigma^-2)
EPS_POINTS = 1000  # eps grid of the privacy profile, from 0 to where delta(eps) stops falling
Y_POINTS = 20_000  # y grid of the inverse (log-spaced over [1e-16, 1]: 0.2% apart)


@dataclass(frozen=True)
class Curve:
    """g = 1 - f of one accounted mechanism (see the module's docstring), with its inverse."""
    sample_rate: float
    sigma: float
    steps: int
    eps: np.ndarray  # the privacy profile's grid
    delta: np.ndarray  # delta(eps) on it (pessimistic)
    ys: tuple  # the inverse's grid
    xs: tuple  # inf{x: g(x) >= y} at each grid y

    def g(self, x):
        """1 - f(x): the largest power of a test of level x between the neighbouring runs."""
        x = np.atleast_1d(np.asarray(x, dtype=np.float64))[:, None]
        e = np.exp(self.eps)[None, :]
        one = np.min(self.delta[None, :] + e * x, axis=1)
        two = np.min(1 - (1 - self.delta[None, :] - x) / e, axis=1)
        return np.clip(np.minimum(one, two), 0.0, 1.0)

    def inverse(self, y: float) -> float:
        """inf{x >= 0: g(x) >= y}, at the grid point at or below y (never above the true value);
        inf where y > 1 (no test reaches a power above 1)."""
        if y > 1.0:
            return math.inf
        i = bisect.bisect_right(self.ys, y) - 1
        return self.xs[i] if i >= 0 else 0.0

    def epsilon(self, delta: float) -> float:
        """The mechanism's eps at ``delta`` (from the same profile)."""
        return _pld(self.sample_rate, self.sigma, self.steps).get_epsilon_for_delta(delta)


@functools.lru_cache(maxsize=64)
def _pld(q: float, sigma: float, steps: int):
    from dp_accounting.pld import privacy_loss_distribution as pld

    one = pld.from_gaussian_mechanism(standard_deviation=sigma, sensitivity=1.0, pessimistic_estimate=True,
                                      value_discretization_interval=DISCRETISATION * max(1.0, sigma**-2),
                                      sampling_prob=q,
                                      use_connect_dots=True)
    return one.self_compose(steps)


def _inverse_table(eps: np.ndarray, delta: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """max(0, max_eps (y - delta) e^-eps, max_eps 1 - delta - e^eps (1 - y)) at every y of ``ys``:
    the inverse of g, each line of g inverted (g(x) >= y iff every line is)."""
    out = np.zeros(ys.size)
    e = np.exp(eps)
    for lo in range(0, ys.size, 2000):
        y = ys[lo:lo + 2000, None]
        one = np.max((y - delta[None, :]) / e[None, :], axis=1)
        two = np.max(1 - delta[None, :] - e[None, :] * (1 - y), axis=1)
        out[lo:lo + 2000] = np.maximum(0.0, np.maximum(one, two))
    return out


def from_profile(eps, delta, *, sample_rate: float = float("nan"), sigma: float = float("nan"), steps: int = 0) -> Curve:
    """The curve of a mechanism that is (eps_i, delta_i)-DP for every pair given: pure eps-DP is
    ``from_profile([eps], [0.0])`` (randomized response's exact curve)."""
    eps, delta = np.asarray(eps, dtype=np.float64), np.asarray(delta, dtype=np.float64)
    ys = np.concatenate([[0.0], np.logspace(-16, 0, Y_POINTS)])
    return Curve(sample_rate=sample_rate, sigma=sigma, steps=steps, eps=eps, delta=delta, ys=tuple(ys.tolist()),
                 xs=tuple(_inverse_table(eps, delta, ys).tolist()))


@functools.lru_cache(maxsize=64)
def curve(sample_rate: float, sigma: float, steps: int) -> Curve:
    """The accounted mechanism's curve: Poisson sampling at ``sample_rate``, Gaussian noise of
    multiplier ``sigma`` (std sigma C on a sum of sensitivity C), ``steps`` compositions."""
    if not 0 < sample_rate <= 1 or not sigma > 0 or steps < 1:
        raise ValueError(f"a DP-SGD curve needs q in (0, 1], sigma > 0 and steps >= 1; got q={sample_rate}, "
                         f"sigma={sigma}, steps={steps}")
    pld = _pld(float(sample_rate), float(sigma), int(steps))
    top = 1.0  # doubled until delta(eps) stops falling (the mass the discretisation leaves at infinity)
    while float(pld.get_delta_for_epsilon(2 * top)) < float(pld.get_delta_for_epsilon(top)) and top < 256:
        top *= 2
    top *= 2
    eps = np.linspace(0.0, top, EPS_POINTS)
    return from_profile(eps, pld.get_delta_for_epsilon(eps), sample_rate=float(sample_rate), sigma=float(sigma),
                        steps=int(steps))


def gaussian(mu: float) -> Curve:
    """The mu-GDP curve g(x) = Phi(Phi^-1(x) + mu) in the same form (a reference for tests: the
    Gaussian mechanism of sensitivity 1 and noise 1 / mu, one step, no sampling)."""
    return curve(1.0, 1.0 / mu, 1)
