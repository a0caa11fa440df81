"""The whole-run audit every task's DP-SGD shares (``python -m pipeline.audit ... audit.scope=run``;
Steinke, Nasr and Jagielski, NeurIPS 2023): one real training run with m canaries, each included
with probability 1/2 (bits drawn before training, read only when scoring), scored after training
and bounded with ``pipeline.auditing.one_run_bound`` against the eps the run's accountant claims.

A task supplies its training loop (its sampling, accountant plan, schedule, optimizer and
checkpointing; ``pipeline/lm/audit.py``); this module holds what every task's run audit shares:
the variants, the power, the scoring into one row, and the record (one MLflow run per audit, with
its figure).

**Variants.** ``engine`` is the run as planned. Each negative control is a run whose training
differs from what the accountant was told, while the claim stays the planned run's:

=====================  ==========================================================  ==============
variant                what the training does                                      sum statistic
=====================  ==========================================================  ==============
noise_halved           noise std sigma C / 2                                       caught (power)
sampling_doubled       samples at 2 q, the accountant assumed q                    caught (power)
accountant_tenth       the noise the accountant gives for a tenth of the steps     caught (power)
no_noise               no noise at all                                             caught
resume_reuses_noise    stopped after half the epochs and resumed from a           cannot
                       checkpoint whose noise generator is the run's first state:
                       the epochs after the resume draw the first epochs' noise
=====================  ==========================================================  ==============

"caught (power)": the control raises every canary's signal-to-noise ratio, so the bound rises;
whether it passes the claim depends on m and on the run (each row reports the power, and
``audit.md`` whether the sum statistic can see the control at all). A white-box
(Dirac) canary's score is its coordinate of the sum of the noisy sums over the run: a replayed
noise draw is added twice, which *raises* that sum's variance, so no choice of m lets the sum
statistic see a resume that reuses noise; a statistic that differences the replayed steps would
(their noise cancels), but it has to know the defect. A clipping defect (Phantom's one-branch
norm) is invisible to Dirac canaries by construction (their gradient is added after clipping, of
norm exactly C); only input-space canaries, whose gradients pass through the engine, could see it.

**Canaries** (``audit.<task>.variants``: ``<variant>`` or ``<variant>:input``): ``dirac`` (white-box, ``pipeline.canaries``: the
strongest) or ``input`` (canary examples with unique random content, each included in the training
data with probability 1/2, scored by minus their loss under the final model: what an attacker of
the released model can do; expect a weak bound; distinct with overwhelming probability, not by
construction).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np

from pipeline import auditing

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


UNSEEN = {"resume_reuses_noise": "the sum statistic cannot see replayed noise"}  # controls it cannot catch


def score(scores: np.ndarray, included: np.ndarray, *, variant: str, canaries: str, claimed, used, n: int,
          eps: float, delta: float, confidence: float = 0.95, guesses: tuple[int, ...] | None = None, power_factor: float = 2.0,
          accountant: str = "prv", unseen: str | None = None) -> dict:
    """One audited run's row: the binomial bound on eps (Steinke et al.), the largest Gaussian
    claim the f-DP test rejects (``gaussian_claim_rejected``: no bound on eps, since subsampled
    DP-SGD's trade-off is not Gaussian), the ceiling for this m, the power and the verdict; ``n``
    is the number of examples the run trained on (input canaries included).

    The power is the binomial bound the same statistic would reach, at expected counts, against the
    same run calibrated to ``power_factor`` times the claim: for Dirac canaries from their sum
    score's separation (``sum_score_mu``), with the variance the data's gradients added in this run
    (``excess_variance``, read from the excluded canaries' scores after scoring). An input canary's
    loss has no such model: its row gives the Dirac figure for reference, and its verdict is never
    ``consistent`` (without a violation it is ``too weak to say``). A control the sum statistic
    cannot catch (``UNSEEN``, or a task's own reason, ``unseen``) says so in its verdict, whatever
    the power."""
    m = len(scores)
    guesses = guesses or default_guesses(m)
    binomial = auditing.one_run_bound(scores, included, delta=delta, confidence=confidence, guesses=guesses)
    fdp = auditing.one_run_bound(scores, included, delta=delta, confidence=confidence, guesses=guesses, bound="fdp")
    excess = excess_variance(scores, included, used) if canaries == "dirac" else 0.0
    mu_alt = sum_score_mu(claimed, alternative_sigma(claimed, power_factor * eps, delta, accountant), excess)
    power = auditing.one_run_power(m, delta=delta, confidence=confidence, guesses=guesses, mu=mu_alt)
    verdict = auditing.one_run_verdict(binomial, eps, power)
    if verdict == "consistent" and canaries == "input":
        verdict = "too weak to say (input canaries: their power is not known)"
    elif (reason := unseen or UNSEEN.get(variant)) and verdict != "violation":  # said whatever the power
        verdict = f"consistent ({reason})" if verdict == "consistent" else f"{verdict}; {reason}"
    return {"variant": variant, "canaries": canaries, "claimed_eps": eps, "delta": delta,
            "sigma_claimed": claimed.sigma, "sigma_used": used.sigma, "sample_rate_used": used.sample_rate,
            "steps": claimed.steps, "n": n,
            "m": m, "included": int(np.sum(included)), "excess_var": excess,
            "mu_claimed": sum_score_mu(claimed, claimed.sigma), "mu_used": sum_score_mu(used, used.sigma),
            "eps_lower": binomial.eps_lower, "gaussian_claim_rejected": fdp.eps_lower,
            "correct": binomial.correct, "guesses": binomial.k_plus + binomial.k_minus,
            "k_plus": binomial.k_plus, "k_minus": binomial.k_minus, "eps_ceiling": binomial.eps_ceiling,
            "power": power, "confidence": confidence, "verdict": verdict}


def figure(scores: np.ndarray, included: np.ndarray, row: dict, path: Path) -> Path:
    """The scores of included and excluded canaries, the thresholds of the winning guesses (the
    ``k_plus`` highest guessed in, the ``k_minus`` lowest out) and the bound."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scores, included = np.asarray(scores, dtype=float), np.asarray(included, dtype=bool)
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    bins = np.linspace(scores.min(), scores.max() + 1e-12, 60)
    ax.hist(scores[included], bins=bins, alpha=0.5, color="tab:red", label=f"included ({included.sum()})")
    ax.hist(scores[~included], bins=bins, alpha=0.5, color="tab:blue", label=f"excluded ({(~included).sum()})")
    ordered = np.sort(scores)
    if row["k_plus"]:
        ax.axvline(ordered[-row["k_plus"]], color="black", ls="--", label=f"guessed in: top {row['k_plus']}")
    if row["k_minus"]:
        ax.axvline(ordered[row["k_minus"] - 1], color="gray", ls=":", label=f"guessed out: bottom {row['k_minus']}")
    ax.set_xlabel("canary score" + (" (sum of its noisy coordinates / C)" if row["canaries"] == "dirac"
                                    else " (minus its loss under the final model)"))
    ax.set_ylabel("canaries")
    ax.set_title(f"{row['variant']} ({row['canaries']}, m = {row['m']}): {row['correct']}/{row['guesses']} right, "
                 f"eps >= {row['eps_lower']:.3g} (claim {row['claimed_eps']:.3g}, ceiling {row['eps_ceiling']:.3g})\n"
                 f"{row['verdict']}", fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def record(row: dict, scores: np.ndarray, included: np.ndarray, *, task: str, out: Path, params: dict) -> Path:
    """One MLflow run for one audited training (tags kind=audit, scope=run): the row's settings as
    parameters, its bounds as metrics, the verdict as a tag, the figure and the scores (with the
    inclusion bits, revealed now that the run is scored) as artifacts."""
    import pandas as pd

    from pipeline import tracking

    name = f"{row['variant']}-{row['canaries']}"
    tags = {"kind": "audit", "scope": "run", "task": task, "variant": row["variant"], "canaries": row["canaries"]}
    with tracking.run(f"audit {task} run {name}", tags):
        metrics = ("eps_lower", "gaussian_claim_rejected", "eps_ceiling", "power", "correct", "mu_used", "mu_claimed")
        tracking.log_params("audit", {k: v for k, v in row.items() if k not in metrics and k != "verdict"})
        tracking.log_params("train", params)
        tracking.log_metrics("audit", {k: min(float(row[k]), 1e6) for k in metrics})
        tracking.set_tag("verdict", row["verdict"])
        fig = figure(scores, included, row, out / f"audit_run_{name}.png")
        table = out / f"audit_run_{name}_scores.csv"
        pd.DataFrame({"score": scores, "included": included}).to_csv(table, index=False)
        tracking.log_artifacts(fig, table)
    return fig


def markdown(table, scale: str) -> str:
    """The audit's table: one row per audited run."""
    lines = [f"Whole-run audit (Steinke et al.'s one-run bound, {100 * table['confidence'].iloc[0]:.0f}% confidence), "
             f"{scale}\n", "| variant | canaries | m | examples | steps | sigma used (claimed) | q used | correct / guesses "
             "| eps lower bound | claim | ceiling | power | verdict |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in table.itertuples():
        lines.append(f"| {r.variant} | {r.canaries} | {r.m} | {r.n} | {r.steps} | {r.sigma_used:.3f} ({r.sigma_claimed:.3f}) | "
                     f"{r.sample_rate_used:.3g} | {r.correct} / {r.guesses} | {r.eps_lower:.3f} | {r.claimed_eps:g} | "
                     f"{r.eps_ceiling:.2f} | {r.power:.2f} | {r.verdict} |")
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
               for k in ("eps_lower", "eps_ceiling", "power", "correct", "guesses") if math.isfinite(r[k])}
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


def start(cfg, variants: list[tuple[str, str]], m_dirac: int, coordinates: int, key: str) -> Path:
    """The audit's folder (Hydra's run folder, emptied of an earlier audit's figures) and its MLflow
    store, once the last refusal is passed: m white-box canaries need m of the model's ``coordinates``."""
    import shutil

    from pipeline import tracking
    from pipeline.validation import ConfigError

    if any(kind == "dirac" for _, kind in variants) and m_dirac > coordinates:
        raise ConfigError(f"{key} = {m_dirac}: each white-box canary is one of the model's {coordinates:,} "
                          "trainable coordinates")
    out = tracking.output_dir()
    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out / "runs", ignore_errors=True)  # a folder run into again holds this audit's figures only
    tracking.setup(cfg)
    return out


def line(row: dict) -> str:
    """One audited run, as the audit prints it."""
    return (f"{row['variant']:19s} {row['canaries']:5s}: eps_lower {row['eps_lower']:.3f} (claim {row['claimed_eps']:g}, "
            f"ceiling {row['eps_ceiling']:.2f}, power {row['power']:.2f})  {row['correct']}/{row['guesses']} right  "
            f"{row['verdict']}")

