"""Validation of a composed config and the derived constants of a cell.

Every constant of the protocol lives in ``conf/``; this module only turns the
documented rules (``null`` in YAML means "use the rule") into numbers, and
refuses, before any compute, a config that the algorithm cannot run on.
"""

from __future__ import annotations

import math

from omegaconf import DictConfig, ListConfig

from pipeline import privacy, validation
from pipeline.noisyhead.constants import FLOAT_MAX, Constants
from pipeline.validation import MAX_INT, ConfigError
from pipeline.validation import number as _number
from pipeline.validation import positive_int as _positive_int


def _positive(value, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"{key} must be a positive number, got {value!r}")
    return _number(value, key)


def _non_negative(value, key: str) -> float:
    number = _number(value, key)
    if number < 0:
        raise ConfigError(f"{key} must be >= 0, got {value!r}")
    return number


def _step_culprit(regime: DictConfig, *, N: int, L: int, G: float) -> str:
    """Who is to blame when the step-size rule gives an eta0 for which the update does not contract:
    the rule's input that was set explicitly, else N (through L = floor(sqrt(N)) and G's rule)."""
    if regime.G is not None:
        return f"regime.G = {regime.G!r} makes the step-size rule give"
    if regime.C is not None:
        return f"regime.C = {regime.C!r} gives G = {G:.6g} by its rule, and the step-size rule then"
    if regime.L is not None:
        return f"regime.L = {regime.L!r} gives G = {G:.6g} by its rule, and the step-size rule then"
    return f"regime.N = {N!r} gives L = {L}, G = {G:.6g} by their rules, and the step-size rule then"


def derive(regime: DictConfig) -> Constants:
    """Apply the rules of ``conf/noisyhead/regime/*.yaml`` (Theorem 4.1 with kappa, and the paper's eta0, T)."""
    N = _positive_int(regime.N, "regime.N")
    L = regime.L if regime.L is not None else math.isqrt(N)
    L = _positive_int(L, "regime.L")
    D = regime.D if regime.D is not None else math.isqrt(N)
    D = _positive_int(D, "regime.D")
    lam = _positive(regime.lam if regime.lam is not None else N / D, "regime.lam")
    tau = _non_negative(regime.tau, "regime.tau")
    kappa = _number(regime.kappa, "regime.kappa")
    if not 0 < kappa <= 1:
        raise ConfigError(f"regime.kappa must lie in (0, 1], got {regime.kappa!r}")

    if regime.C is not None:
        C = _positive(regime.C, "regime.C")
    else:
        try:
            C = math.sqrt(2 * (1 + tau**2) * math.log(N * L / kappa))
        except OverflowError:  # tau**2 beyond float64
            raise ConfigError(f"regime.tau = {regime.tau!r} is too large: C's rule sqrt(2 (1 + tau^2) log(N L / kappa)) "
                              "overflows float64") from None
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
    for name, value in (("C", C), ("G", G), ("R", R)):
        if not math.isfinite(value) or not math.isfinite(value * value):
            how = "" if regime[name] is not None else f" by its rule (regime.N = {N}, L = {L}, D = {D}, tau = {tau:g})"
            raise ConfigError(f"regime.{name} = {value:.6g}{how} is too large to compute with (its square overflows)")
    if regime.eta0 is not None:
        eta0 = _positive(regime.eta0, "regime.eta0")
        culprit = f"regime.eta0 = {eta0:.6g} gives"
    else:
        scale = _positive(regime.eta0_scale, "regime.eta0_scale")
        try:
            eta0 = scale * 2 * lam / (3 * (lam + G**2) ** 2)
        except OverflowError:  # (lam + G^2)^2 beyond float64: eta0 = 0 in the limit, refused below
            eta0 = 0.0
        culprit = _step_culprit(regime, N=N, L=L, G=G) + f" eta0 = {eta0:.6g}, for which"
    contraction = 1 - eta0 * lam
    if not 0 < contraction < 1:
        raise ConfigError(f"{culprit} 1 - eta0 * lam = {contraction:.6g}, which must lie in (0, 1) (lam = {lam:.6g})")
    if not 0 < 1 - 2 * lam * eta0 < 1:
        raise ConfigError(
            f"{culprit} 1 - 2 lam eta0 = {1 - 2 * lam * eta0:.6g}, "
            f"which must lie in (0, 1) for Algorithm 1's update to contract (lam = {lam:.6g})"
        )
    T = regime.T
    if T is None:
        power = _positive(regime.T_log_power, "regime.T_log_power")
        steps = power * math.log(N) / math.log(1 / contraction)
        if not steps <= MAX_INT:
            raise ConfigError(f"regime.T_log_power = {regime.T_log_power!r} gives T = {steps:.3g} steps by the rule "
                              f"T = floor(T_log_power log N / log(1 / (1 - eta0 lam))), more than 2^53")
        T = math.floor(steps)
        if T < 1:
            raise ConfigError(f"the rule for regime.T gives T = {T}; set regime.T explicitly")
    Ts = tuple(T) if isinstance(T, (list, tuple, ListConfig)) else (T,)
    if not Ts:
        raise ConfigError("regime.T must not be an empty list")
    Ts = tuple(_positive_int(t, "regime.T") for t in Ts)
    init_scale = _non_negative(regime.init_scale, "regime.init_scale")
    return Constants(
        N=N, L=L, D=D, lam=lam, tau=tau, C=C, G=G, R=R, eta0=eta0, T=Ts,
        init_scale=init_scale, sigma=privacy.noisyhead_sensitivity(C=C, G=G, R=R),
    )


def validate(cfg: DictConfig) -> Constants:
    """Check a composed config; return the cell's constants or raise ConfigError."""
    _positive_int(cfg.trials, "trials")
    validation.seed(cfg.seed)
    _positive_int(cfg.dataset.n_test, "dataset.n_test")
    _positive_int(cfg.compute.chunk_trials, "compute.chunk_trials")
    validation.threads(cfg.compute.threads, "compute.threads")
    if cfg.compute.dtype not in ("float32", "float64"):
        raise ConfigError(f"compute.dtype must be float32 or float64, got {cfg.compute.dtype!r}")
    if cfg.oracle not in ("update", "printed"):
        raise ConfigError(f"oracle must be 'update' or 'printed', got {cfg.oracle!r}")
    _check_report(cfg)
    from pipeline.noisyhead.methods import ESTIMATORS  # late import: methods import this module's types

    methods = cfg.get("method")
    if not isinstance(methods, DictConfig) or not methods:
        raise ConfigError("method = [] selects no estimator; name some, with the ridge oracle: 'method=[ridge,noisyhead]'")
    for name, spec in methods.items():
        if not isinstance(spec, DictConfig):
            raise ConfigError(f"method.{name} must be a method's settings (conf/noisyhead/method/{name}.yaml), got {spec!r}")
        if spec.get("estimator") not in ESTIMATORS:
            raise ConfigError(f"method.{name}.estimator {spec.get('estimator')!r} is unknown; known: {sorted(ESTIMATORS)}")
    if "ridge" not in cfg.method or cfg.method.ridge.estimator != "ridge":
        raise ConfigError("method must include ridge: it is the oracle every excess risk is measured against")
    const = derive(cfg.regime)  # first: it refuses a bad regime.N or regime.L, which the dataset check uses
    _check_dataset(cfg, prompt=const.L + 1)
    _check_attack(cfg.attack, N=const.N, D=const.D, tau=const.tau, dtype=cfg.compute.dtype)
    _check_privacy(cfg.privacy)
    _check_sizes(cfg.regime, const, cfg.compute.dtype)
    for name, spec in cfg.method.items():
        if "noise_scale" in spec:  # base.noise_scale: the audit's under-noised controls set it below 1
            _non_negative(spec.noise_scale, f"method.{name}.noise_scale")
        check = getattr(ESTIMATORS[spec.estimator], "check", None)
        problem = check(spec, cfg, const) if check else None
        if problem:
            raise ConfigError(f"method.{name}: {problem}")
    return const


def _check_dataset(cfg: DictConfig, prompt: int) -> None:
    """The dataset is known and its files are there, readable, and hold at least ``prompt`` (L + 1)
    articles in every newsgroup of each split (before any compute)."""
    from pipeline.noisyhead.data import DATASETS

    dataset = cfg.dataset
    if dataset.name not in DATASETS:
        raise ConfigError(f"dataset.name {dataset.name!r} is unknown; known: {sorted(DATASETS)}")
    if dataset.name != "newsgroups":
        return
    from pipeline.noisyhead import newsgroups

    if cfg.attack.name != "none":
        raise ConfigError("attack: the perturbation attack needs dataset=synthetic (it perturbs drawn tokens)")
    if dataset.D != cfg.regime.D:
        raise ConfigError(f"dataset.D = {dataset.D} must equal regime.D = {cfg.regime.D}")
    if dataset.vectorizer_fit not in newsgroups.SPLITS:
        raise ConfigError(f"dataset.vectorizer_fit must be one of {newsgroups.SPLITS}, got {dataset.vectorizer_fit!r}")
    try:
        if dataset.features:
            key = "dataset.features"
            found = newsgroups.load(dataset.features, newsgroups.meta_of(dataset))
            counts = {split: [int((groups == g).sum()) for g in set(groups.tolist())]
                      for split, groups in found.group.items()}
        elif dataset.archive:
            key = "dataset.archive"
            counts = {split: list(groups.values()) for split, groups in newsgroups.check_archive(dataset.archive).items()}
        else:
            return
    except newsgroups.DataError as err:
        raise ConfigError(str(err)) from err
    for split, sizes in counts.items():
        if min(sizes) < prompt:
            raise ConfigError(f"{key}: a newsgroup of the {split} split has {min(sizes)} articles, "
                              f"fewer than the L + 1 = {prompt} a prompt takes")




def _feature_limit(N: int, dtype: str) -> float:
    """log10 of the largest feature norm whose square, summed over N prompts, stays finite in
    ``dtype`` with two orders of magnitude to spare."""
    return (math.log10(FLOAT_MAX[dtype]) - math.log10(N)) / 2 - 2


def _check_sizes(regime: DictConfig, const: Constants, dtype: str) -> None:
    """The noise level tau and the start's scale must leave every number of the algebra finite in
    ``dtype``: responses below 10 (1 + tau) in practice, so features of norm up to 2 D 10 (1 + tau)
    (as in ``_check_attack`` with mu = alpha = 0), squared and summed over N prompts; the start's
    D x D entries init_scale N(0, 1) (below 40 in size), squared in its Frobenius norm."""
    limit = _feature_limit(const.N, dtype)
    log_feature = math.log10(const.D) + math.log10(10 * (1 + const.tau)) + math.log10(2)
    if log_feature > limit:
        raise ConfigError(f"regime.tau = {regime.tau!r} is too large: the prompts' features reach about "
                          f"1e{log_feature:.0f}, beyond what {dtype} arithmetic on N = {const.N} prompts can hold "
                          f"(1e{limit:.0f})")
    largest = math.sqrt(FLOAT_MAX[dtype]) / (40 * const.D)
    if const.init_scale > largest:
        raise ConfigError(f"regime.init_scale = {regime.init_scale!r} is too large: the start's squared Frobenius "
                          f"norm would overflow {dtype}; keep it below {largest:.3g} (the start is projected onto "
                          f"the ball of radius R = {const.R:.3g} anyway)")


def _check_attack(cfg: DictConfig, *, N: int, D: int, tau: float, dtype: str) -> None:
    if cfg.name == "none":
        return
    from pipeline.noisyhead.attacks import ATTACKS

    if cfg.name not in ATTACKS:
        raise ConfigError(f"attack.name {cfg.name!r} is unknown; known: none, {', '.join(ATTACKS)}")
    prompts = cfg.prompts
    if isinstance(prompts, bool) or not isinstance(prompts, int) or not 1 <= prompts <= N:
        raise ConfigError(f"attack.prompts must be an integer in [1, N = {N}], got {prompts!r}")
    if cfg.choice != "uniform":
        raise ConfigError(f"attack.choice {cfg.choice!r} is unknown; known: uniform")
    mu, c, p = (_number(cfg[key], f"attack.{key}") for key in ("mu", "c", "p"))
    # Every number the attacked prompts lead to must stay finite in float64 (and the features'
    # squares, in the gram and the risks, summed over N prompts). Their size, in log10: tokens
    # up to sqrt(D) (1 + |mu|), responses up to |y| + alpha (|y| below 10 (1 + tau) in practice),
    # so ||Z|| = ||q|| ||v|| <= D (1 + |mu|)^2 (alpha + 10 (1 + tau)).
    log_alpha = math.log10(abs(c)) + p * math.log10(N) if c != 0 else -math.inf
    log_response = max(log_alpha, math.log10(10 * (1 + tau))) + math.log10(2)
    log_tokens = 2 * math.log10(1 + abs(mu))
    log_feature = math.log10(D) + log_tokens + log_response
    limit = _feature_limit(N, dtype)  # ||Z||^2 N, with room to spare
    if log_feature > limit:
        if log_tokens >= log_response:
            key, value = "attack.mu", cfg.mu
        else:
            key, value = ("attack.p", cfg.p) if abs(p * math.log10(N)) >= abs(math.log10(abs(c))) else ("attack.c", cfg.c)
        raise ConfigError(
            f"{key} = {value!r} is too large: the attacked prompts' features reach about 1e{log_feature:.0f} "
            f"(alpha = c N^p = {f'1e{log_alpha:.0f}' if c else 0}, tokens shifted by mu), beyond what {dtype} arithmetic on "
            f"N = {N} prompts can hold (1e{limit:.0f}); keep them below that"
        )


def _check_privacy(cfg: DictConfig) -> None:
    """Refuse a privacy budget no mechanism can be calibrated to (each private estimator's
    ``check`` refuses what its own calibration cannot honour)."""
    eps, delta = cfg.eps, cfg.delta
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < math.inf:
        raise ConfigError(f"privacy.eps must be a positive finite number (eps = inf is no privacy), got {eps!r}")
    validation.epsilon(eps)  # at most MAX_EPS: DP-SGD's calibration never ends near 1e308
    if isinstance(delta, bool) or not isinstance(delta, (int, float)) or not 0 < delta < 1:
        raise ConfigError(f"privacy.delta must lie in (0, 1), got {delta!r}")
    if cfg.accountant not in privacy.ACCOUNTANTS:
        raise ConfigError(f"privacy.accountant {cfg.accountant!r} is unknown; known: {list(privacy.ACCOUNTANTS)}")


PLOT_MEASURES = ("excess_risk", "test_mse", "attack_risk")
PLOT_COMMON = (None, "auto", "none", "N", "T", "eps", "method")  # columns and choices most plots use
PLOT_ERROR_BARS = ("sd", "log_sd")
PLOT_SCALES = ("linear", "log", "symlog", "logit")


def _check_report(cfg: DictConfig) -> None:
    """The evaluation and plot settings (read only after the compute, so checked here)."""
    level = _number(cfg.evaluate.ci_level, "evaluate.ci_level")
    if not 0 < level < 1:
        raise ConfigError(f"evaluate.ci_level must lie in (0, 1), got {cfg.evaluate.ci_level!r}")
    plot = cfg.plot
    ys = [plot.y] if isinstance(plot.y, str) else list(plot.y) if isinstance(plot.y, ListConfig) else [plot.y]
    if not ys:
        raise ConfigError("plot.y must name a measure, got []")
    for y in ys:
        if y not in PLOT_MEASURES:
            raise ConfigError(f"plot.y {y!r} is unknown; known: {list(PLOT_MEASURES)}")
        if y == "attack_risk" and cfg.attack.name == "none":
            raise ConfigError("plot.y attack_risk needs an attack (attack=perturb); with attack=none there is none")
    if plot.error_bars not in PLOT_ERROR_BARS:
        raise ConfigError(f"plot.error_bars {plot.error_bars!r} is unknown; known: {list(PLOT_ERROR_BARS)}")
    if plot.yscale not in PLOT_SCALES:
        raise ConfigError(f"plot.yscale {plot.yscale!r} is unknown; known: {list(PLOT_SCALES)}")
    if _number(plot.k_sd, "plot.k_sd") < 0:
        raise ConfigError(f"plot.k_sd must be >= 0, got {plot.k_sd!r}")
    for key, allowed in (("x", ("auto",)), ("hue", (None, "auto")), ("facet", (None, "none"))):
        value = plot[key]
        if value in allowed or (value in PLOT_COMMON and value not in (None, "auto", "none")):
            continue
        from pipeline.noisyhead.evaluate import COLUMNS  # (it imports MLflow: only when needed)

        if value not in COLUMNS:
            raise ConfigError(f"plot.{key} {value!r} is not a column of results.csv "
                              f"(nor {' or '.join(str(a) for a in allowed)})")
    methods = cfg.get("method")
    for name in plot.methods or []:
        if isinstance(methods, DictConfig) and name not in methods:
            raise ConfigError(f"plot.methods names {name!r}, which is not among the methods run: {list(methods)}")
    colors = plot.get("colors")
    if colors is not None:
        if not isinstance(colors, DictConfig):
            raise ConfigError(f"plot.colors must map method names (or legend entries) to colours, got {colors!r}")
        from matplotlib.colors import is_color_like

        for name, colour in colors.items():
            if not isinstance(colour, str) or not is_color_like(colour):
                raise ConfigError(f"plot.colors.{name} = {colour!r} is not a matplotlib colour")
    _check_table(cfg)


def _check_table(cfg: DictConfig) -> None:
    """``report.table`` (the sweep's table, drawn after every cell): its rows are columns of
    results.csv, its values measures."""
    spec = cfg.report.get("table")
    if not spec:
        return
    if not isinstance(spec, DictConfig) or "rows" not in spec or "value" not in spec:
        raise ConfigError(f"report.table must be {{rows: [columns], value: measure or [measures]}}, got {spec!r}")
    rows = [spec.rows] if isinstance(spec.rows, str) else list(spec.rows) if isinstance(spec.rows, ListConfig) else None
    if not rows:
        raise ConfigError(f"report.table.rows must name columns of results.csv, got {spec.rows!r}")
    from pipeline.noisyhead.evaluate import COLUMNS

    for row in rows:
        if row not in COLUMNS:
            raise ConfigError(f"report.table.rows names {row!r}, which is not a column of results.csv")
    values = [spec.value] if isinstance(spec.value, str) else list(spec.value) if isinstance(spec.value, ListConfig) else None
    if not values:
        raise ConfigError(f"report.table.value must name a measure or a list of them, got {spec.value!r}")
    for value in values:
        if value not in PLOT_MEASURES:
            raise ConfigError(f"report.table.value {value!r} is unknown; known: {list(PLOT_MEASURES)}")
        if value == "attack_risk" and cfg.attack.name == "none":
            raise ConfigError("report.table.value attack_risk needs an attack (attack=perturb); with attack=none there is none")
