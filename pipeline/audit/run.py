"""The whole-run audit every task's DP-SGD shares (``python -m pipeline.audit ... audit.scope=run``;
Steinke, Nasr and Jagielski, NeurIPS 2023): one real training run with m canaries, each included
with probability 1/2 (bits drawn before training, read only when scoring), scored after training
and bounded against the eps the run's accountant claims.

A task supplies its training loop (its sampling, accountant plan, schedule, optimizer and
checkpointing; ``pipeline/lm/audit.py``, ``pipeline/seqrec/audit_run.py``); this module holds what
every task's run audit shares: the variants, the scores' bounds, the power, the plan, the sanity
check, the scoring into one row, and the record (one MLflow run per audit, with its figure).

**Scores.** A white-box (Dirac) canary is scored by the sum over the steps of its per-step
log-likelihood ratio, "included" against "excluded", under the Poisson-subsampled Gaussian
mechanism as run (``pipeline.audit.canaries``): the statistic. Its sum of noisy coordinates (the earlier
release's score) is reported beside it. Where the noise multiplier is small the ratio keeps what the
sum throws away (a step that did not sample a canary adds only noise to its sum).

**Three bounds from the same scores** (``bounds``), each with its ceiling for the run's m:
Steinke et al.'s binomial bound (a proof at the audit's confidence: the verdict's), Mahloujifar et
al.'s f-DP test of the Gaussian trade-off turned into a bound (the largest (eps, delta) Gaussian
claim the guesses reject), and the Gaussian-DP bound (mu from Clopper-Pearson bounds on the error
rates at the ROC hull's thresholds, eps at the run's delta; as jax_privacy's ``epsilon_from_gdp``).
The last two hold for a mechanism with a Gaussian trade-off, which DP-SGD's composition of many
subsampled steps approaches but need not meet: a verdict they alone carry says so.

**Before and after.** ``audit.plan_only=true`` prints, before anything runs, each bound's expected
value (the canaries simulated alone, ``simulate``) and ceiling for the run as configured. After a
run, ``sanity`` compares the excluded canaries' ratio scores with those of a simulated run without
data (Kolmogorov-Smirnov): the data's gradients dominating the noise, or noise replayed or missing,
show there.

**Variants.** ``engine`` is the run as planned. Each negative control is a run whose training
differs from what the accountant was told, while the claim stays the planned run's:

=====================  ==========================================================  ================
variant                what the training does                                      caught by
=====================  ==========================================================  ================
noise_halved           noise std sigma C / 2                                       the bounds (m)
sampling_doubled       samples at 2 q, the accountant assumed q                    the bounds (m)
accountant_tenth       the noise the accountant gives for a tenth of the steps     the bounds (m)
no_noise               no noise at all                                             every bound
resume_reuses_noise    stopped after half the epochs and resumed from a           the sanity
                       checkpoint whose noise generator is the run's first state:  check (m)
                       the epochs after the resume draw the first epochs' noise
=====================  ==========================================================  ================

"the bounds (m)": the control raises every canary's signal-to-noise ratio, so the bounds rise;
whether they pass the claim depends on m and on the run (each row reports the power, and
``audit.plan_only`` what to expect). A replayed noise draw is added twice, which raises the scores'
variance: no bound sees it, while the excluded scores' law moves away from the simulated one. A
clipping defect (Phantom's one-branch norm) is invisible to Dirac canaries by construction (their
gradient is added after clipping, of norm exactly C); only input-space canaries, whose gradients
pass through the engine, could see it.

**Canaries** (``audit.<task>.variants``: ``<variant>`` or ``<variant>:input``): ``dirac`` (white-box,
``pipeline.audit.canaries``: the strongest) or ``input`` (canary examples with unique random content, each
included in the training data with probability 1/2, scored by minus their loss under the final
model: what an attacker of the released model can do; expect a weak bound; distinct with
overwhelming probability, not by construction).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path

import numpy as np

from pipeline.audit import one_run

log = logging.getLogger(__name__)
VARIANTS = ("engine", "noise_halved", "sampling_doubled", "accountant_tenth", "no_noise", "resume_reuses_noise")
CANARIES = ("dirac", "input")


def actual_plan(claimed, variant: str, *, eps: float, delta: float, accountant: str):
    """What the training does under ``variant`` (a task's plan: a dataclass with ``sigma``,
    ``sample_rate`` and ``steps``), while the claim stays ``claimed``'s. ``resume_reuses_noise``
    keeps the plan: its defect is in the resume, which the task's audit performs."""
    from pipeline import privacy

    if variant in ("engine", "resume_reuses_noise"):
        return claimed
    if variant == "noise_halved":
        return dataclasses.replace(claimed, sigma=claimed.sigma / 2)
    if variant == "sampling_doubled":
        return dataclasses.replace(claimed, sample_rate=min(1.0, 2 * claimed.sample_rate))
    if variant == "accountant_tenth":
        told = max(1, claimed.steps // 10)
        return dataclasses.replace(claimed, sigma=privacy.dpsgd_noise_multiplier(
            eps=eps, delta=delta, sample_rate=claimed.sample_rate, steps=told, accountant=accountant))
    if variant == "no_noise":
        return dataclasses.replace(claimed, sigma=0.0)
    raise ValueError(f"unknown audit variant {variant!r}; known: {VARIANTS}")


MU_MAX = 40.0  # a separation past any threshold the power's search uses: perfect separation


def sum_score_mu(plan, sigma: float, excess_var: float = 0.0) -> float:
    """The separation, in standard deviations, of an included Dirac canary's sum score from an
    excluded one's: mean q T (units of C), variance T sigma^2 from the noise, T q (1 - q) from the
    sampling, and ``excess_var`` from the data's gradients on the canary's coordinate (0: neglected):
    q T / sqrt(T sigma^2 + T q (1 - q) + excess_var); at most ``MU_MAX`` (no noise at q = 1)."""
    q, T = plan.sample_rate, plan.steps
    var = T * sigma**2 + T * q * (1 - q) + excess_var
    return MU_MAX if var <= 0 else min(MU_MAX, q * T / math.sqrt(var))


def excess_variance(scores: np.ndarray, included: np.ndarray, used) -> float:
    """The variance of the excluded Dirac canaries' scores beyond the noise's T sigma^2: what the
    data's gradients (and any replayed noise) add on the canaries' coordinates, read after scoring
    (the power, not the bound, uses it)."""
    out = np.asarray(scores, dtype=float)[~np.asarray(included, dtype=bool)]
    if out.size < 2:
        return 0.0
    return max(0.0, float(np.var(out, ddof=1)) - used.steps * used.sigma**2)


def alternative_sigma(claimed, eps_alt: float, delta: float, accountant: str) -> float:
    """The noise multiplier of the same run (rate, steps) calibrated to ``eps_alt``: the audit's
    power is the bound its statistic reaches against that run (a clear violation of the claim)."""
    from pipeline import privacy

    return privacy.dpsgd_noise_multiplier(eps=eps_alt, delta=delta, sample_rate=claimed.sample_rate,
                                          steps=claimed.steps, accountant=accountant)


def default_guesses(m: int) -> tuple[int, ...]:
    """The guess counts tried (Bonferroni over them): a tenth, half and all of the canaries."""
    return tuple(sorted({max(1, m // 10), max(1, m // 2), m}))


UNSEEN = {"resume_reuses_noise": "no bound sees replayed noise (the sanity check of the excluded scores can)"}
SANITY = 1e-3  # a sanity p-value below this is said in the verdict


def simulate(m: int, *, q: float, sigma: float, steps: int, seed: int, C: float = 1.0,
             chunk: int = 2**22) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The canaries alone under the Poisson-subsampled Gaussian mechanism: m Dirac canaries, each
    included with probability 1/2, each included one added (C) at a step with probability q, N(0,
    (sigma C)^2) on every coordinate at every step, scored as a run scores them (``pipeline.audit.canaries``:
    the sum / C and the per-step log-likelihood ratio with each step's moments read from the
    observations): (sum scores, ratio scores, inclusion bits). What a run without data shows: the
    plan's expected bounds (``expected``), the power, and the law the real excluded canaries' scores
    must follow (``sanity``). ``sigma`` may include the data's spread on the canaries' coordinates."""
    from pipeline.audit.canaries import step_llr, step_moments

    rng = np.random.default_rng(seed)
    bits = rng.random(m) < 0.5
    linear, llr = np.zeros(m), np.zeros(m)
    per = max(1, chunk // max(1, m))
    for start in range(0, steps, per):
        k = min(per, steps - start)
        y = C * ((rng.random((k, m)) < q) & bits) + sigma * C * rng.standard_normal((k, m))
        for row in y:
            mu, v = step_moments(row, q=q, C=C)
            llr += step_llr(row, mu=mu, v=v, q=q, C=C)
        linear += y.sum(0) / C
    return linear, llr, bits


PROOFS = ("steinke", "fdp")  # tests whose rejection is a theorem's conclusion at the audit's confidence
ESTIMATES = ("gauss", "gdp")  # numbers that hold only if the run's trade-off is Gaussian: estimates, never proofs


@dataclasses.dataclass(frozen=True)
class Tests:
    """One statistic's scores, tested four ways: two proofs and two estimates."""
    steinke: one_run.OneRun  # proof: Steinke et al.'s lower bound on eps ((eps, delta)-DP rejected below it)
    fdp: one_run.FDPTest | None  # proof: the f-DP test against the accountant's own curve (None: not run)
    gauss: one_run.OneRun  # estimate: Mahloujifar et al.'s recursion under a Gaussian trade-off
    gdp: one_run.GDP  # estimate: the Gaussian-DP mu and its eps

    def proved(self) -> tuple[str, float]:
        """The larger proved eps, and which test gave it."""
        fdp = self.fdp.eps_proved if self.fdp is not None else float("nan")
        return max((("steinke", self.steinke.eps_lower), ("fdp", fdp if math.isfinite(fdp) else 0.0)),
                   key=lambda kv: kv[1])

    def estimated(self) -> float:
        """The larger estimate under a Gaussian trade-off (no proof of anything)."""
        return max(self.gauss.eps_lower, self.gdp.eps)


TESTS = PROOFS + ESTIMATES  # the order of Tests' fields


def _test(kind: str, scores: np.ndarray, included: np.ndarray, *, claimed, delta: float, confidence: float,
          guesses: tuple[int, ...], proved: bool = True, ceiling: bool = True):
    """One of the four tests of ``scores``, the one place each is built: Steinke et al.'s bound, the f-DP
    test against the accountant's curve of ``claimed`` (a plan: ``sample_rate``, ``sigma``, ``steps``;
    None without noise), Mahloujifar et al.'s recursion under a Gaussian trade-off, the Gaussian-DP mu."""
    if kind == "steinke":
        return one_run.one_run_bound(scores, included, delta=delta, confidence=confidence, guesses=guesses)
    if kind == "fdp":
        return (one_run.fdp_test(scores, included, sample_rate=claimed.sample_rate, sigma=claimed.sigma,
                                 steps=claimed.steps, delta=delta, confidence=confidence, guesses=guesses, proved=proved,
                                 ceiling=ceiling) if claimed.sigma > 0 else None)
    if kind == "gauss":
        return one_run.one_run_bound(scores, included, delta=delta, confidence=confidence, guesses=guesses,
                                     bound="gaussian")
    if kind == "gdp":
        return one_run.gdp_estimate(scores, included, delta=delta, confidence=confidence)
    raise ValueError(f"unknown test {kind!r}; known: {PROOFS + ESTIMATES}")


def _value(kind: str, scores, bits, claimed, delta, confidence, guesses) -> float:
    """One test's eps from ``scores``: the proofs' lower bounds, the estimates' values."""
    found = _test(kind, scores, bits, claimed=claimed, delta=delta, confidence=confidence, guesses=guesses,
                  ceiling=False)
    if found is None:
        return float("nan")
    return found.eps_proved if kind == "fdp" else found.eps if kind == "gdp" else found.eps_lower


def tests(scores: np.ndarray, included: np.ndarray, *, claimed, delta: float, confidence: float,
          guesses: tuple[int, ...], proved: bool = True, fdp: bool = True) -> Tests:
    """The four tests (``_test``) of the same scores (``proved=False``: the f-DP test's p-value only,
    ``fdp=False``: not run)."""
    return Tests(**{kind: _test(kind, scores, included, claimed=claimed, delta=delta, confidence=confidence,
                                guesses=guesses, proved=proved) if kind != "fdp" or fdp else None for kind in TESTS})


def expected(m: int, *, q: float, sigma: float, steps: int, delta: float, confidence: float, claimed,
             guesses: tuple[int, ...] | None = None, seeds: int = 3, statistics: tuple[str, ...] = ("llr", "sum"),
             kinds: tuple[str, ...] = PROOFS + ESTIMATES) -> dict[str, dict[str, float]]:
    """What a run that trains at (q, sigma, steps) shows against the claim ``claimed`` (the plan the
    accountant was told), by simulation of its canaries alone (``simulate``): for each of
    ``statistics`` ("llr", "sum") and ``kinds`` (``PROOFS`` and ``ESTIMATES``), the median over
    ``seeds`` simulated runs of its eps (a proof's lower bound, an estimate's value)."""
    guesses = guesses or default_guesses(m)
    found: dict[str, dict[str, list[float]]] = {name: {kind: [] for kind in kinds} for name in statistics}
    for seed in range(seeds):
        linear, llr, bits = simulate(m, q=q, sigma=sigma, steps=steps, seed=seed)
        for name in statistics:
            for kind in kinds:
                found[name][kind].append(_value(kind, llr if name == "llr" else linear, bits, claimed, delta,
                                                confidence, guesses))
    return {name: {kind: float(np.median(v)) for kind, v in per.items()} for name, per in found.items()}


def ceilings(m: int, *, delta: float, confidence: float, claimed, guesses: tuple[int, ...] | None = None
             ) -> dict[str, float]:
    """The largest value each test can give with m canaries (every guess right; perfect separation
    of m / 2 included from m / 2 excluded for the Gaussian-DP estimate); the f-DP test's is the
    largest eps of the claim's family (its q and steps) it could reject."""
    guesses = guesses or default_guesses(m)
    half = np.arange(m) < m // 2
    bits = half.astype(float)
    fdp = (one_run.fdp_test(bits, half, sample_rate=claimed.sample_rate, sigma=claimed.sigma, steps=claimed.steps,
                            delta=delta, confidence=confidence, guesses=guesses).eps_ceiling
           if claimed.sigma > 0 else float("nan"))
    return {"steinke": one_run.one_run_ceiling(m, delta=delta, confidence=confidence, guesses=guesses), "fdp": fdp,
            "gauss": one_run.one_run_ceiling(m, delta=delta, confidence=confidence, guesses=guesses, bound="gaussian"),
            "gdp": one_run.gdp_estimate(bits, half, delta=delta, confidence=confidence).eps_ceiling}


def effective_sigma(white_box, used) -> float:
    """The run's noise on the canaries' coordinates, in units of C: the root mean of the per-step
    excluded variances the canaries read (the noise and the data's gradients), at least the plan's."""
    v = np.array([var for _, var in white_box.moments]) if white_box.moments else np.zeros(1)
    return max(used.sigma, math.sqrt(float(np.mean(v))) / white_box.C)


def sanity(white_box, included: np.ndarray, used, seed: int = 0) -> float:
    """The p-value of a two-sample Kolmogorov-Smirnov test of the run's excluded canaries' ratio
    scores against the excluded canaries of a simulation of the same run without data (``simulate``
    at the run's q, steps and effective noise): small where the scores are not what the mechanism as
    run would give (a wrong q, noise the run did not add, a score bug)."""
    from scipy.stats import ks_2samp

    _, llr, bits = simulate(white_box.m, q=white_box.q, sigma=effective_sigma(white_box, used), steps=white_box.steps(),
                            seed=seed + 1)
    real = white_box.llr_scores()[~np.asarray(included, dtype=bool)]
    return float(ks_2samp(real, llr[~bits]).pvalue)


def verdict(main: Tests, eps: float, power: float) -> str:
    """``violation (...)`` where a proof rejects the claim: Steinke's bound above it, or the f-DP test
    rejecting the accountant's curve; else ``consistent`` where a proof could have shown a clear
    violation (``power`` above the claim and below the ceilings), else ``too weak to say (...)``.
    Estimates above the claim are said, as estimates, and never make a violation."""
    found = []
    if main.steinke.eps_lower > eps:
        found.append(f"Steinke: eps >= {main.steinke.eps_lower:.3g} > claim {eps:g}")
    if main.fdp is not None and main.fdp.rejected:
        found.append(f"f-DP test: not the accounted mechanism, p = {main.fdp.p_value:.2g}")
    if found:
        return f"violation ({'; '.join(found)})"
    ceiling = max(main.steinke.eps_ceiling, main.fdp.eps_ceiling if main.fdp is not None else 0.0)
    if ceiling <= eps or power <= eps:
        out = (f"too weak to say (m = {main.steinke.m} canaries prove at most {ceiling:.3g}; a clear violation "
               f"would prove {power:.3g})")
    else:
        out = "consistent"
    if main.estimated() > eps:
        out += (f"; estimates under a Gaussian trade-off above the claim (f-DP {main.gauss.eps_lower:.3g}, GDP "
                f"{main.gdp.eps:.3g}): not a proof")
    return out


def score(scores: np.ndarray, included: np.ndarray, *, variant: str, canaries: str, claimed, used, n: int,
          eps: float, delta: float, confidence: float = 0.95, guesses: tuple[int, ...] | None = None, power_factor: float = 2.0,
          accountant: str = "prv", unseen: str | None = None, white_box=None) -> dict:
    """One audited run's row; ``n`` is the number of examples the run trained on (input canaries
    included). ``white_box``: the run's Dirac canaries (``pipeline.audit.canaries.DiracCanaries``), whose
    per-step log-likelihood ratio scores are the audit's statistic (``statistic = llr``), their sum
    scores (``scores``) reported beside; input canaries are scored by ``scores`` (minus their loss).

    From the statistic (``tests``), two proofs at the audit's confidence: Steinke et al.'s lower bound
    on eps (``eps_lower``) and the f-DP test of the scores against the curve of the mechanism the
    accountant composed (``fdp_p``; ``fdp_eps_proved``: the eps of the most private run of that family
    the scores reject); and two estimates that hold only under a Gaussian trade-off, which DP-SGD's
    composed steps approach but need not meet (``gauss_eps_estimate``, ``gdp_eps_estimate``): they
    never make a violation. Each has its ceiling for this m. ``sanity_p``: the excluded canaries'
    ratio scores against a simulation of the run without data (``sanity``).

    The power is the larger proof the statistic reaches, in simulation (median of three), against the
    same run calibrated to ``power_factor`` times the claim, its noise on the canaries' coordinates
    raised by what the data's gradients added in this run. An input canary's loss has no such model:
    its row gives the Dirac figure for reference, and its verdict is never ``consistent``. A control
    the statistic cannot catch (``UNSEEN``, or a task's own reason, ``unseen``) says so in its
    verdict, whatever the power."""
    m = len(scores)
    guesses = guesses or default_guesses(m)
    log.info("scoring %s:%s (m = %d): the proofs and estimates, then the power (three simulated runs at %g times the "
             "claim) and the sanity check", variant, canaries, m, power_factor)
    linear = np.asarray(scores, dtype=np.float64)
    primary = white_box.llr_scores() if white_box is not None else linear
    main = tests(primary, included, claimed=claimed, delta=delta, confidence=confidence, guesses=guesses)
    side = (tests(linear, included, claimed=claimed, delta=delta, confidence=confidence, guesses=guesses, proved=False)
            if white_box is not None else None)
    excess = excess_variance(linear, included, used) if canaries == "dirac" else 0.0
    alt = alternative_sigma(claimed, power_factor * eps, delta, accountant)
    noise = effective_sigma(white_box, used) if white_box is not None else used.sigma
    extra = max(0.0, noise**2 - used.sigma**2)  # the data's share, per step, in units of C^2
    power = max(expected(m, q=claimed.sample_rate, sigma=math.sqrt(alt**2 + extra), steps=claimed.steps, delta=delta,
                         confidence=confidence, claimed=claimed, guesses=guesses, statistics=("llr",),
                         kinds=PROOFS)["llr"].values())
    said = verdict(main, eps, power)
    if said == "consistent" and canaries == "input":
        said = "too weak to say (input canaries: their power is not known)"
    elif (reason := unseen or UNSEEN.get(variant)) and not said.startswith("violation"):  # said whatever the power
        said = f"consistent ({reason})" if said == "consistent" else f"{said}; {reason}"
    best, best_value = main.proved()
    nan = float("nan")
    checked = sanity(white_box, included, used) if white_box is not None else nan
    if checked < SANITY and not said.startswith("violation"):  # what no test showed, the scores' law may
        said += (f"; the excluded canaries' scores are off the simulated run without data (KS p = {checked:.2g}): "
                 "the data's gradients dominate the noise, or noise is replayed or missing")
    fdp = main.fdp
    return {"variant": variant, "canaries": canaries, "statistic": "llr" if white_box is not None else "loss",
            "claimed_eps": eps, "delta": delta,
            "sigma_claimed": claimed.sigma, "sigma_used": used.sigma, "sigma_effective": noise,
            "sample_rate_used": used.sample_rate, "steps": claimed.steps, "n": n,
            "m": m, "included": int(np.sum(included)), "excess_var": excess,
            "mu_claimed": sum_score_mu(claimed, claimed.sigma), "mu_used": sum_score_mu(used, used.sigma),
            "eps_lower": main.steinke.eps_lower, "fdp_p": fdp.p_value if fdp else nan,
            "fdp_eps_proved": fdp.eps_proved if fdp else nan,
            "best_proved": best_value, "best_kind": best,
            "gauss_eps_estimate": main.gauss.eps_lower, "gdp_mu_estimate": main.gdp.mu,
            "gdp_eps_estimate": main.gdp.eps, "best_estimate": main.estimated(),
            "sum_eps_lower": side.steinke.eps_lower if side else nan,
            "sum_fdp_p": side.fdp.p_value if side and side.fdp else nan,
            "sum_gdp_eps_estimate": side.gdp.eps if side else nan,
            "correct": main.steinke.correct, "guesses": main.steinke.k_plus + main.steinke.k_minus,
            "k_plus": main.steinke.k_plus, "k_minus": main.steinke.k_minus,
            "fdp_correct": fdp.correct if fdp else -1, "fdp_guesses": fdp.k_plus + fdp.k_minus if fdp else -1,
            "eps_ceiling": main.steinke.eps_ceiling, "fdp_ceiling": fdp.eps_ceiling if fdp else nan,
            "gauss_ceiling": main.gauss.eps_ceiling, "gdp_ceiling": main.gdp.eps_ceiling,
            "power": power, "sanity_p": checked,
            "confidence": confidence, "verdict": said}


def figure(scores: np.ndarray, included: np.ndarray, row: dict, path: Path, white_box=None) -> Path:
    """The scores of included and excluded canaries, the thresholds of the winning guesses (the
    ``k_plus`` highest guessed in, the ``k_minus`` lowest out) and the bounds: for white-box canaries
    the per-step ratio scores (the statistic) beside their sum scores."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    included = np.asarray(included, dtype=bool)
    panels = [(np.asarray(scores, dtype=float), "canary score" + (" (sum of its noisy coordinates / C)"
                                                                   if row["canaries"] == "dirac"
                                                                   else " (minus its loss under the final model)"))]
    if white_box is not None:
        panels.insert(0, (white_box.llr_scores(), "canary score (sum of its per-step log-likelihood ratios)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.2), squeeze=False)
    for k, (ax, (values, label)) in enumerate(zip(axes[0], panels)):
        bins = np.linspace(values.min(), values.max() + 1e-12, 60)
        ax.hist(values[included], bins=bins, alpha=0.5, color="tab:red", label=f"included ({included.sum()})")
        ax.hist(values[~included], bins=bins, alpha=0.5, color="tab:blue", label=f"excluded ({(~included).sum()})")
        if k == 0:  # the statistic: the guesses the bound counts
            ordered = np.sort(values)
            if row["k_plus"]:
                ax.axvline(ordered[-row["k_plus"]], color="black", ls="--", label=f"guessed in: top {row['k_plus']}")
            if row["k_minus"]:
                ax.axvline(ordered[row["k_minus"] - 1], color="gray", ls=":", label=f"guessed out: bottom {row['k_minus']}")
        ax.set_xlabel(label)
        ax.set_ylabel("canaries")
        ax.legend(fontsize=8)
    axes[0][0].set_title(f"{row['variant']} ({row['canaries']}, m = {row['m']}): {row['correct']}/{row['guesses']} right, "
                         f"eps >= {row['eps_lower']:.3g} (Steinke; claim {row['claimed_eps']:.3g}, ceiling "
                         f"{row['eps_ceiling']:.3g}); f-DP test p = {row['fdp_p']:.2g}, eps >= {row['fdp_eps_proved']:.3g}; "
                         f"estimates: f-DP {row['gauss_eps_estimate']:.3g}, GDP {row['gdp_eps_estimate']:.3g}\n"
                         f"{row['verdict']}", fontsize=8)
    if white_box is not None:
        axes[0][1].set_title(f"the sum statistic: Steinke eps >= {row['sum_eps_lower']:.3g}, f-DP test p = "
                             f"{row['sum_fdp_p']:.2g}; GDP estimate {row['sum_gdp_eps_estimate']:.3g}", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def record(row: dict, scores: np.ndarray, included: np.ndarray, *, task: str, out: Path, params: dict,
           white_box=None) -> Path:
    """One MLflow run for one audited training (tags kind=audit, scope=run): the row's settings as
    parameters, its bounds as metrics, the verdict as a tag, the figure and the scores (with the
    inclusion bits, revealed now that the run is scored) as artifacts."""
    import pandas as pd

    from pipeline import tracking

    name = f"{row['variant']}-{row['canaries']}"
    tags = {"kind": "audit", "scope": "run", "task": task, "variant": row["variant"], "canaries": row["canaries"]}
    with tracking.run(f"audit {task} run {name}", tags):
        tracking.log_params("audit", {k: v for k, v in row.items() if k not in METRICS and k != "verdict"})
        tracking.log_params("train", params)
        tracking.log_metrics("audit", {k: min(float(row[k]), 1e6) for k in METRICS if math.isfinite(row[k])})
        tracking.set_tag("verdict", row["verdict"])
        fig = figure(scores, included, row, out / f"audit_run_{name}.png", white_box)
        table = out / f"audit_run_{name}_scores.csv"
        columns = {"score": scores, "included": included}
        if white_box is not None:
            columns = {"llr": white_box.llr_scores(), **columns}
        pd.DataFrame(columns).to_csv(table, index=False)
        tracking.log_artifacts(fig, table)
    return fig


METRICS = ("eps_lower", "fdp_p", "fdp_eps_proved", "best_proved", "gauss_eps_estimate", "gdp_mu_estimate",
           "gdp_eps_estimate", "best_estimate", "sum_eps_lower", "sum_fdp_p", "sum_gdp_eps_estimate", "eps_ceiling",
           "fdp_ceiling", "gauss_ceiling", "gdp_ceiling", "power", "correct", "mu_used", "mu_claimed", "sigma_effective",
           "sanity_p")  # a row's numbers, logged as MLflow metrics


def markdown(table, scale: str) -> str:
    """The audit's table: one row per audited run, its two proofs (Steinke's bound; the f-DP test
    against the accountant's curve, its p-value and the eps it proves), its two estimates under a
    Gaussian trade-off, and for white-box canaries the sum statistic's, with the ceilings."""
    f = (lambda v: "-" if not math.isfinite(v) else f"{v:.2f}")
    g = (lambda v: "-" if not math.isfinite(v) else f"{v:.2g}")
    lines = [f"Whole-run audit (one run, {100 * table['confidence'].iloc[0]:.0f}% confidence; statistic: per-step "
             f"log-likelihood ratio for white-box canaries, minus the loss for input canaries), {scale}. Proofs: "
             "Steinke's lower bound on eps; the f-DP test of the accountant's own curve (p, and the eps it proves). "
             "Estimates (true only if the run's trade-off is Gaussian; never a proof): f-DP and GDP.\n",
             "| variant | canaries | m | steps | sigma used (claimed) | q used | proof: Steinke eps >= | proof: f-DP p "
             "(eps >=) | estimates: f-DP / GDP (mu) | sum: Steinke / f-DP p | ceilings: Steinke / f-DP | claim | power "
             "| sanity p | verdict |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in table.itertuples():
        lines.append(f"| {r.variant} | {r.canaries} | {r.m} | {r.steps} | {r.sigma_used:.3f} ({r.sigma_claimed:.3f}) | "
                     f"{r.sample_rate_used:.3g} | {r.eps_lower:.3f} ({r.correct} / {r.guesses}) | {g(r.fdp_p)} "
                     f"({f(r.fdp_eps_proved)}) | {f(r.gauss_eps_estimate)} / {f(r.gdp_eps_estimate)} "
                     f"({r.gdp_mu_estimate:.2f}) | {f(r.sum_eps_lower)} / {g(r.sum_fdp_p)} | {r.eps_ceiling:.2f} / "
                     f"{f(r.fdp_ceiling)} | {r.claimed_eps:g} | {r.power:.2f} | {f(r.sanity_p)} | {r.verdict} |")
    return "\n".join(lines) + "\n"


def publish(rows: list[dict], out: Path, report_dir, *, scale: str, claimed_eps: float):
    """``audit.csv``, ``audit.md`` and ``metrics.json`` (strict JSON: a non-finite value left out) of
    every audited run in ``out`` (the audit's folder, beside each run's figure in ``out/runs``) and,
    where ``report_dir`` is set, copied there with the figures (a DVC stage's artifacts); the table."""
    import json
    import shutil

    import pandas as pd

    table = pd.DataFrame(rows)
    table.to_csv(out / "audit.csv", index=False)
    (out / "audit.md").write_text(markdown(table, scale))
    metrics = {f"{r['variant']}.{r['canaries']}.{k}": r[k] for r in rows
               for k in ("eps_lower", "fdp_p", "fdp_eps_proved", "gauss_eps_estimate", "gdp_eps_estimate", "sum_eps_lower",
                         "eps_ceiling", "fdp_ceiling", "power", "correct", "guesses", "sanity_p") if math.isfinite(r[k])}
    (out / "metrics.json").write_text(json.dumps(metrics | {"claimed_eps": claimed_eps, "runs": len(rows)}, indent=1) + "\n")
    where = [out]
    if report_dir:
        report = Path(str(report_dir))
        if report.resolve() != out.resolve():
            report.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(report / "runs", ignore_errors=True)
            shutil.copytree(out / "runs", report / "runs")
            for name in ("audit.csv", "audit.md", "metrics.json"):
                shutil.copy2(out / name, report / name)
            where.append(report)
    print(f"wrote audit.csv, audit.md and metrics.json to {' and '.join(map(str, where))}; one MLflow run per "
          "variant (kind=audit, scope=run)", flush=True)
    return table


def parse_variants(spec, key: str, variants: tuple[str, ...] = VARIANTS) -> list[tuple[str, str]]:
    """``[engine, no_noise, engine:input]`` -> [(variant, canaries)]: a variant name of ``variants``,
    optionally followed by ``:input`` (input-space canaries) or ``:dirac`` (the default); ``key``
    names the setting in refusals."""
    from pipeline.validation import ConfigError

    out = []
    if isinstance(spec, str):  # one variant given as a string (audit.lm.variants=engine): a list of one, not letters
        spec = [spec]
    for entry in list(spec or ["engine"]):
        variant, _, kind = str(entry).partition(":")
        kind = kind or "dirac"
        if variant not in variants:
            raise ConfigError(f"{key}: {entry!r} is unknown; known: {list(variants)}, each optionally :input or :dirac")
        if kind not in CANARIES:
            raise ConfigError(f"{key}: {entry!r} names canaries {kind!r}; known: {list(CANARIES)}")
        if (variant, kind) in out:
            raise ConfigError(f"{key}: {entry!r} is named twice (each audit is one run, one MLflow run and one figure)")
        out.append((variant, kind))
    return out


def _check_canaries(variants: list[tuple[str, str]], m_dirac: int, coordinates: int, key: str) -> None:
    """m white-box canaries need m of the model's ``coordinates``."""
    from pipeline.validation import ConfigError

    if any(kind == "dirac" for _, kind in variants) and m_dirac > coordinates:
        raise ConfigError(f"{key} = {m_dirac}: each white-box canary is one of the model's {coordinates:,} "
                          "trainable coordinates")


def plan(variants: list[tuple[str, str]], m: dict, *, claimed, eps: float, delta: float, accountant: str,
         confidence: float, seeds: int = 3, power_factor: float = 2.0) -> list[dict]:
    """What each configured audit can show before it runs: per variant, the training as run (its
    sigma, q and steps), each test's expected value for the per-step ratio statistic and the proofs'
    for the sum (``expected``: the canaries alone, no data, so an upper estimate where the data's
    gradients add spread on the canaries' coordinates), each test's ceiling for its m, and the power:
    what the proofs show, in the same simulation, of a run calibrated to ``power_factor`` times the claim."""
    rows, tops, powers = [], {}, {}
    for variant, kind in variants:
        used = actual_plan(claimed, "engine" if variant not in VARIANTS else variant, eps=eps, delta=delta,
                           accountant=accountant)
        row = {"variant": variant, "canaries": kind, "m": m[kind], "claimed_eps": eps, "sigma_used": used.sigma,
               "sample_rate_used": used.sample_rate, "steps": used.steps}
        if m[kind] not in tops:
            tops[m[kind]] = ceilings(m[kind], delta=delta, confidence=confidence, claimed=claimed)
            alt = alternative_sigma(claimed, power_factor * eps, delta, accountant)
            powers[m[kind]] = expected(m[kind], q=claimed.sample_rate, sigma=alt, steps=claimed.steps, delta=delta,
                                       confidence=confidence, claimed=claimed, seeds=seeds, statistics=("llr",),
                                       kinds=PROOFS)["llr"]
        row |= {f"ceiling_{k}": v for k, v in tops[m[kind]].items()}
        row |= {f"power_{k}": v for k, v in powers[m[kind]].items()}
        if kind == "dirac":
            found = expected(m[kind], q=used.sample_rate, sigma=used.sigma, steps=used.steps, delta=delta,
                             confidence=confidence, claimed=claimed, seeds=seeds, statistics=("llr",))
            found |= expected(m[kind], q=used.sample_rate, sigma=used.sigma, steps=used.steps, delta=delta,
                              confidence=confidence, claimed=claimed, seeds=seeds, statistics=("sum",), kinds=PROOFS)
            row |= {f"{stat}_{k}": v for stat, per in found.items() for k, v in per.items()}
        rows.append(row)
    return rows


def plan_only(cfg, variants: list[tuple[str, str]], m: dict, coordinates: int, key: str, *, claimed, eps: float,
              delta: float, accountant: str) -> bool:
    """``audit.plan_only=true``: print ``plan``'s table (before any training, MLflow run or folder) and
    return True; otherwise False. Either way the canary count is checked first."""
    _check_canaries(variants, m["dirac"], coordinates, key)
    if not cfg.audit.get("plan_only"):
        return False
    from pipeline import preflight

    rows = plan(variants, m, claimed=claimed, eps=eps, delta=delta, accountant=accountant,
                confidence=float(cfg.audit.confidence), power_factor=float(cfg.audit.get("power_factor", 2.0)))
    f = (lambda v: "-" if v is None or not math.isfinite(v) else f"{v:.2f}")
    print(f"audit plan (claim eps = {eps:g}, delta = {delta:g}, {100 * float(cfg.audit.confidence):.0f}% confidence; "
          "expected values simulate the canaries alone, without the data's gradients: an upper estimate). Proofs: "
          "Steinke's bound and the f-DP test against the accountant's curve; estimates (a Gaussian trade-off "
          "assumed, never a proof): f-DP and GDP")
    print(f"{'variant':28s} {'m':>6s} {'sigma':>7s} {'q':>7s} {'steps':>6s}   expected proofs Steinke / f-DP, estimates "
          "f-DP / GDP (ratio) | proofs (sum)   ceilings: proofs | estimates   power (proofs)")
    for r in rows:
        name = f"{r['variant']}:{r['canaries']}"
        exp = (f"{f(r.get('llr_steinke'))} / {f(r.get('llr_fdp'))}, {f(r.get('llr_gauss'))} / {f(r.get('llr_gdp'))} | "
               f"{f(r.get('sum_steinke'))} / {f(r.get('sum_fdp'))}"
               if r["canaries"] == "dirac" else "input canaries: no model of their scores")
        print(f"{name:28s} {r['m']:6d} {r['sigma_used']:7.3f} {r['sample_rate_used']:7.3g} {r['steps']:6d}   {exp}   "
              f"{f(r['ceiling_steinke'])} / {f(r['ceiling_fdp'])} | {f(r['ceiling_gauss'])} / {f(r['ceiling_gdp'])}   "
              f"{f(r['power_steinke'])} / {f(r['power_fdp'])}", flush=True)
    preflight.forget_run_folder()  # nothing ran: no folder left
    return True


def start(cfg, variants: list[tuple[str, str]], m_dirac: int, coordinates: int, key: str) -> Path:
    """The audit's folder (Hydra's run folder, emptied of an earlier audit's figures) and its MLflow
    store, once the last refusal is passed: m white-box canaries need m of the model's ``coordinates``."""
    import shutil

    from pipeline import tracking

    _check_canaries(variants, m_dirac, coordinates, key)
    out = tracking.output_dir()
    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out / "runs", ignore_errors=True)  # a folder run into again holds this audit's figures only
    tracking.setup(cfg)
    return out


def line(row: dict) -> str:
    """One audited run, as the audit prints it."""
    return (f"{row['variant']:19s} {row['canaries']:5s}: proofs: eps >= {row['eps_lower']:.3f} (Steinke), f-DP test p = "
            f"{row['fdp_p']:.2g} (eps >= {row['fdp_eps_proved']:.3f}); claim {row['claimed_eps']:g}, ceilings "
            f"{row['eps_ceiling']:.2f} / {row['fdp_ceiling']:.2f}, power {row['power']:.2f}; estimates f-DP "
            f"{row['gauss_eps_estimate']:.3f}, GDP {row['gdp_eps_estimate']:.3f}  {row['correct']}/{row['guesses']} "
            f"right  {row['verdict']}")
