"""The plan of a DP-SGD run: its Poisson sampling rate, its steps, and the noise multiplier the
project's accountant gives for the target (eps, delta); the eps that noise actually spends. Every
task's training and the public API (``pipeline.dpsgd.DPSGD``) plan here, and every task's validation
asks ``check`` before any data is read, so that a budget the accountant cannot reach is one
``error:`` line naming the key and value.

Conventions (Opacus's): the expected batch is B = min(batch_size, n), q = B / n, one epoch is
round(n / B) steps (at least one), and ``steps = epochs x steps_per_epoch``. A share of (eps,
delta) spent by another mechanism of the same run (a private vocabulary, Re-Attention's item
histogram) is taken off first; the rest is DP-SGD's, and the two compose by basic composition
(``eps_spent`` = DP-SGD's eps as the accountant reports it + the share's eps).

Guarantee (``pipeline.privacy.dpsgd_noise_multiplier``): ``steps`` steps of the Poisson-subsampled
Gaussian mechanism at rate q with noise multiplier ``sigma`` on a sum whose one example moves it
by at most C (add/remove adjacency of one example) are (eps, delta)-DP by the accountant
(``rdp`` or ``prv``, Opacus's). A run without noise (``private=False`` or eps = inf) has none.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from functools import lru_cache

ACCOUNTANTS = ("rdp", "prv")  # Opacus's accountants that calibrate DP-SGD's noise


class Unreachable(ValueError):
    """An (eps, delta) that no noise multiplier reaches with the run's sampling rate and steps; ``why``:
    the accountant's reason alone (a task's refusal names its own keys around it)."""

    def __init__(self, message: str, why: str = ""):
        super().__init__(message)
        self.why = why or message


@dataclass(frozen=True)
class Plan:
    """The numbers a DP-SGD run is calibrated with (frozen: an audit's negative control is a
    ``dataclasses.replace`` of it)."""

    n: int  # examples (the privacy unit: users, posts, sequences)
    batch_size: int  # the expected (Poisson) batch size B = q n
    sample_rate: float  # q
    steps_per_epoch: int
    steps: int
    sigma: float  # the noise multiplier (0: no noise)
    eps_spent: float  # what the accountant gives for sigma, plus the share's eps (inf without noise)
    delta: float
    private: bool
    accountant: str = "prv"
    share: float = 0.0  # the share of (eps, delta) another mechanism of the run spends

    def as_params(self) -> dict:
        return asdict(self)


def sizes(n: int, batch_size: int, epochs: int) -> tuple[int, float, int, int]:
    """(B, q, steps per epoch, steps) of ``epochs`` epochs of Poisson batches of expected size ``batch_size``."""
    B = min(int(batch_size), int(n))
    q = B / n
    per_epoch = max(1, round(n / B))
    return B, q, per_epoch, int(epochs) * per_epoch


def plan(*, n: int, batch_size: int, epochs: int, eps: float, delta: float, private: bool = True,
         accountant: str = "prv", share: float = 0.0) -> Plan:
    """The run's sampling rate, steps and noise multiplier; ``Unreachable`` (a ValueError) where the
    accountant cannot calibrate DP-SGD's share of (eps, delta)."""
    from pipeline import privacy

    if not 0 <= share < 1:
        raise ValueError(f"the share of the budget spent elsewhere must lie in [0, 1), got {share}")
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"accountant {accountant!r} is unknown; known: {list(ACCOUNTANTS)}")
    B, q, per_epoch, steps = sizes(n, batch_size, epochs)
    if private and math.isfinite(eps):
        e, d = (1 - share) * eps, (1 - share) * delta
        try:
            sigma = privacy.dpsgd_noise_multiplier(eps=e, delta=d, sample_rate=q, steps=steps, accountant=accountant)
        except ValueError as err:
            why = str(err).strip().rstrip(".")
            raise Unreachable(f"{why}: no noise multiplier gives eps = {e:g}, delta = {d:g} at sampling rate "
                              f"q = {q:.4g} over {steps} steps; raise eps or delta, or take fewer steps (fewer "
                              "epochs, a smaller batch_size)", why) from None
        spent = float(privacy.dpsgd_spent_epsilon(sigma=sigma, delta=d, sample_rate=q, steps=steps,
                                                  accountant=accountant)) + share * eps  # a float, not NumPy's
    else:
        sigma, spent = 0.0, math.inf
    return Plan(n, B, q, per_epoch, steps, sigma, spent, delta, bool(private), accountant, share)


def spent(sigma: float, *, delta: float, sample_rate: float, steps: int, accountant: str) -> float:
    """The eps the accountant gives for ``steps`` steps taken so far (0 before the first, inf without noise)."""
    from pipeline import privacy

    if steps == 0:
        return 0.0
    if sigma <= 0:
        return math.inf
    return privacy.dpsgd_spent_epsilon(sigma=sigma, delta=delta, sample_rate=sample_rate, steps=steps,
                                       accountant=accountant)


@lru_cache(maxsize=256)
def refusal(*, eps: float, delta: float, n: int, batch_size: int, epochs: int, accountant: str,
            share: float = 0.0) -> str | None:
    """None if the plan of these settings can be made, else the accountant's reason (cached: a
    sweep's validation asks once per distinct cell)."""
    try:
        plan(n=n, batch_size=batch_size, epochs=epochs, eps=eps, delta=delta, accountant=accountant, share=share)
    except Unreachable as err:
        return err.why
    return None


def check(*, eps: float, delta: float, n: int, batch_size: int, epochs: int, accountant: str, share: float = 0.0,
          keys: dict[str, str]) -> None:
    """A task's validation of its privacy settings: ``ConfigError`` (one ``error:`` line, exit 2,
    before any data is prepared, any folder or run) where the plan cannot be made. ``keys`` names
    the config keys of ``eps``, ``delta``, ``batch_size``, ``epochs`` and ``accountant``."""
    from pipeline.validation import ConfigError

    if not math.isfinite(float(eps)):
        return
    why = refusal(eps=float(eps), delta=float(delta), n=int(n), batch_size=int(batch_size), epochs=int(epochs),
                  accountant=str(accountant), share=float(share))
    if why is None:
        return
    B, q, _, steps = sizes(int(n), int(batch_size), int(epochs))
    shared = f" (DP-SGD's share: {1 - share:g} of both)" if share else ""
    why = why[:1].lower() + why[1:]
    raise ConfigError(
        f"{keys['eps']} = {eps!r} with {keys['delta']} = {delta!r}{shared} cannot be reached by DP-SGD at q = {B}/{n} "
        f"= {q:.3g} over {steps} steps ({keys['batch_size']} = {batch_size}, {keys['epochs']} = {epochs}, "
        f"{keys['accountant']} = {accountant}): {why}; raise {keys['eps']} or {keys['delta']}")
