"""Validation of a composed config and the derived constants of a cell.

Every constant of the protocol lives in ``conf/``; this module only turns the
documented rules (``null`` in YAML means "use the rule") into numbers, and
refuses, before any compute, a config that the algorithm cannot run on.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from omegaconf import DictConfig, ListConfig

from pipeline import privacy


class ConfigError(ValueError):
    """A config value the pipeline refuses; the message names the key and the value."""


@dataclass(frozen=True)
class Constants:
    """The numbers one cell runs with, rules already applied."""

    N: int
    L: int
    D: int
    lam: float
    tau: float
    C: float
    G: float
    R: float
    eta0: float
    T: tuple[int, ...]  # one or more horizons; every T is its own private run
    init_scale: float
    sigma: float  # sensitivity constant of Theorem 3.2: 2 G (C + R G)

    def as_params(self) -> dict[str, object]:
        d = asdict(self)
        d["T"] = ",".join(str(t) for t in self.T)
        return d


def _positive_int(value, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{key} must be a positive integer, got {value!r}")
    return value


def _positive(value, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"{key} must be a positive number, got {value!r}")
    return float(value)


def derive(regime: DictConfig) -> Constants:
    """Apply the rules of ``conf/regime/*.yaml`` (Theorem 4.1 with kappa, and the paper's eta0, T)."""
    N = _positive_int(regime.N, "regime.N")
    L = regime.L if regime.L is not None else math.isqrt(N)
    L = _positive_int(L, "regime.L")
    D = regime.D if regime.D is not None else math.isqrt(N)
    D = _positive_int(D, "regime.D")
    lam = _positive(regime.lam if regime.lam is not None else N / D, "regime.lam")
    tau = float(regime.tau)
    if tau < 0:
        raise ConfigError(f"regime.tau must be >= 0, got {regime.tau!r}")
    kappa = float(regime.kappa)
    if not 0 < kappa <= 1:
        raise ConfigError(f"regime.kappa must lie in (0, 1], got {regime.kappa!r}")

    if regime.C is not None:
        C = _positive(regime.C, "regime.C")
    else:
        C = math.sqrt(2 * (1 + tau**2) * math.log(N * L / kappa))
    if regime.G is not None:
        G = _positive(regime.G, "regime.G")
    else:
        G = (C / math.sqrt(L)) * (1 + (math.log(N / kappa) / D**2) ** 0.25)
    if regime.R is not None:
        R = _positive(regime.R, "regime.R")
    else:
        r_scale = regime.R_scale if regime.R_scale is not None else 1 / lam
        r_scale = _positive(r_scale, "regime.R_scale")
        R = r_scale * C**2 * math.sqrt(N / L) * (1 + (math.log(1 / kappa) / D**2) ** 0.25)
    if regime.eta0 is not None:
        eta0 = _positive(regime.eta0, "regime.eta0")
    else:
        scale = _positive(regime.eta0_scale, "regime.eta0_scale")
        eta0 = scale * 2 * lam / (3 * (lam + G**2) ** 2)
    contraction = 1 - eta0 * lam
    if not 0 < contraction < 1:
        raise ConfigError(
            f"regime.eta0 = {eta0:.6g} gives 1 - eta0 * lam = {contraction:.6g}, "
            f"which must lie in (0, 1) (lam = {lam:.6g})"
        )
    if not 0 < 1 - 2 * lam * eta0 < 1:
        raise ConfigError(
            f"regime.eta0 = {eta0:.6g} gives 1 - 2 lam eta0 = {1 - 2 * lam * eta0:.6g}, "
            f"which must lie in (0, 1) for Algorithm 1's update to contract (lam = {lam:.6g})"
        )
    T = regime.T
    if T is None:
        power = _positive(regime.T_log_power, "regime.T_log_power")
        T = math.floor(power * math.log(N) / math.log(1 / contraction))
        if T < 1:
            raise ConfigError(f"the rule for regime.T gives T = {T}; set regime.T explicitly")
    Ts = tuple(T) if isinstance(T, (list, tuple, ListConfig)) else (T,)
    if not Ts:
        raise ConfigError("regime.T must not be an empty list")
    Ts = tuple(_positive_int(t, "regime.T") for t in Ts)
    init_scale = float(regime.init_scale)
    if init_scale < 0:
        raise ConfigError(f"regime.init_scale must be >= 0, got {regime.init_scale!r}")
    return Constants(
        N=N, L=L, D=D, lam=lam, tau=tau, C=C, G=G, R=R, eta0=eta0, T=Ts,
        init_scale=init_scale, sigma=privacy.noisyhead_sensitivity(C=C, G=G, R=R),
    )


def validate(cfg: DictConfig) -> Constants:
    """Check a composed config; return the cell's constants or raise ConfigError."""
    _positive_int(cfg.trials, "trials")
    if isinstance(cfg.seed, bool) or not isinstance(cfg.seed, int) or cfg.seed < 0:
        raise ConfigError(f"seed must be a non-negative integer, got {cfg.seed!r}")
    _positive_int(cfg.dataset.n_test, "dataset.n_test")
    _positive_int(cfg.compute.chunk_trials, "compute.chunk_trials")
    if cfg.compute.dtype not in ("float32", "float64"):
        raise ConfigError(f"compute.dtype must be float32 or float64, got {cfg.compute.dtype!r}")
    if cfg.oracle not in ("update", "printed"):
        raise ConfigError(f"oracle must be 'update' or 'printed', got {cfg.oracle!r}")
    from pipeline.methods import ESTIMATORS  # late import: methods import this module's types

    for name, spec in cfg.method.items():
        if spec.get("estimator") not in ESTIMATORS:
            raise ConfigError(f"method.{name}.estimator {spec.get('estimator')!r} is unknown; known: {sorted(ESTIMATORS)}")
    if "ridge" not in cfg.method or cfg.method.ridge.estimator != "ridge":
        raise ConfigError("method must include ridge: it is the oracle every excess risk is measured against")
    _check_dataset(cfg)
    const = derive(cfg.regime)
    _check_attack(cfg.attack, N=const.N)
    _check_privacy(cfg.privacy)
    for name, spec in cfg.method.items():
        check = getattr(ESTIMATORS[spec.estimator], "check", None)
        problem = check(spec, cfg, const) if check else None
        if problem:
            raise ConfigError(f"method.{name}: {problem}")
    return const


def _check_dataset(cfg: DictConfig) -> None:
    """The dataset is known and its files are there and readable (before any compute)."""
    from pipeline.data import DATASETS

    dataset = cfg.dataset
    if dataset.name not in DATASETS:
        raise ConfigError(f"dataset.name {dataset.name!r} is unknown; known: {sorted(DATASETS)}")
    if dataset.name != "newsgroups":
        return
    from pipeline import newsgroups

    if cfg.attack.name != "none":
        raise ConfigError("attack: the perturbation attack needs dataset=synthetic (it perturbs drawn tokens)")
    if dataset.D != cfg.regime.D:
        raise ConfigError(f"dataset.D = {dataset.D} must equal regime.D = {cfg.regime.D}")
    if dataset.vectorizer_fit not in newsgroups.SPLITS:
        raise ConfigError(f"dataset.vectorizer_fit must be one of {newsgroups.SPLITS}, got {dataset.vectorizer_fit!r}")
    try:
        if dataset.features:
            newsgroups.load(dataset.features, newsgroups.meta_of(dataset))
        elif dataset.archive:
            newsgroups.check_archive(dataset.archive)
    except newsgroups.DataError as err:
        raise ConfigError(str(err)) from err


def _check_attack(cfg: DictConfig, *, N: int) -> None:
    if cfg.name == "none":
        return
    from pipeline.attacks import ATTACKS

    if cfg.name not in ATTACKS:
        raise ConfigError(f"attack.name {cfg.name!r} is unknown; known: none, {', '.join(ATTACKS)}")
    prompts = cfg.prompts
    if isinstance(prompts, bool) or not isinstance(prompts, int) or not 1 <= prompts <= N:
        raise ConfigError(f"attack.prompts must be an integer in [1, N = {N}], got {prompts!r}")
    if cfg.choice != "uniform":
        raise ConfigError(f"attack.choice {cfg.choice!r} is unknown; known: uniform")
    for key in ("mu", "c", "p"):
        value = cfg[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"attack.{key} must be a finite number, got {value!r}")


def _check_privacy(cfg: DictConfig) -> None:
    """Refuse a privacy budget no mechanism can be calibrated to (each private estimator's
    ``check`` refuses what its own calibration cannot honour)."""
    eps, delta = cfg.eps, cfg.delta
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise ConfigError(f"privacy.eps must be a positive number, got {eps!r}")
    if isinstance(delta, bool) or not isinstance(delta, (int, float)) or not 0 < delta < 1:
        raise ConfigError(f"privacy.delta must lie in (0, 1), got {delta!r}")
    if cfg.accountant not in privacy.ACCOUNTANTS:
        raise ConfigError(f"privacy.accountant {cfg.accountant!r} is unknown; known: {list(privacy.ACCOUNTANTS)}")
